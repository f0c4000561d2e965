"""A broad, fixed test corpus: prose, licence text, docstrings, code, non-English, emoji, and
long passages near a model's maximum length. The int8 kernels that saturate (u8 x s8 pairs summed
in int16 on CPUs without VNNI) fail on such ordinary text, not on word soup, so numeric checks
of quantized recipes use this rather than support.corpus alone."""

from __future__ import annotations

from .corpus import sentences

PASSAGES = (
    # prose
    "The river had risen overnight, and by morning the low road into town was under a foot of brown water. "
    "Farmers stood at the edge of their fields, watching the current carry branches and the occasional fence "
    "post past the old mill, and talked quietly about the harvest they would not bring in this year.",
    "Vector search systems first embed every document into a fixed-size vector, then build an approximate "
    "nearest-neighbour index over those vectors. At query time the query is embedded with the same model and "
    "the index returns the closest documents, which a slower cross-encoder may rerank before they are shown.",
    "Photosynthesis converts light energy into chemical energy: chlorophyll absorbs photons, water is split, "
    "oxygen is released, and the energy is stored in molecules of glucose that the plant uses to grow.",
    "In 1869 Dmitri Mendeleev arranged the known elements by atomic weight and noticed that their properties "
    "repeated at regular intervals; he left gaps in his table for elements nobody had yet discovered.",
    # licence text
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software and "
    'associated documentation files (the "Software"), to deal in the Software without restriction, including '
    "without limitation the rights to use, copy, modify, merge, publish, distribute, sublicense, and/or sell "
    'copies of the Software. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR '
    "IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE "
    "AND NONINFRINGEMENT.",
    'Licensed under the Apache License, Version 2.0 (the "License"); you may not use this file except in '
    "compliance with the License. Unless required by applicable law or agreed to in writing, software "
    'distributed under the License is distributed on an "AS IS" BASIS, WITHOUT WARRANTIES OR CONDITIONS OF '
    "ANY KIND, either express or implied.",
    # docstrings
    "Return a new list containing all items from the iterable in ascending order. A custom key function can "
    "be supplied to customize the sort order, and the reverse flag can be set to request the result in "
    "descending order.",
    "Open file and return a corresponding file object. If the file cannot be opened, an OSError is raised. "
    "mode is an optional string that specifies the mode in which the file is opened; it defaults to 'r'.",
    # code
    'def cosine(a, b):\n    """Cosine similarity of two vectors."""\n    return float(a @ b) / '
    "(np.linalg.norm(a) * np.linalg.norm(b))\n\nfor i, row in enumerate(matrix):\n    if row.sum() == 0:\n"
    "        continue\n    print(i, cosine(row, query))",
    "SELECT customer_id, COUNT(*) AS orders, SUM(total) FROM orders WHERE created_at >= '2024-01-01' "
    "GROUP BY customer_id HAVING COUNT(*) > 3 ORDER BY SUM(total) DESC LIMIT 20;",
    '#include <stdio.h>\nint main(void) {\n    for (int i = 0; i < 10; ++i) printf("%d\\n", i * i);\n    return 0;\n}',
    # non-English, emoji, numbers
    "Der schnelle braune Fuchs springt über den faulen Hund, während die Sonne langsam hinter den Bergen "
    "untergeht. La recherche sémantique trouve des documents proches par le sens plutôt que par les mots.",
    "東京は日本の首都であり、世界最大の都市圏の一つです。 Москва — столица России. 🚀🔥 great release, "
    "thanks team!!! 👍👍 #ml #search",
    "Order #48213 shipped 2024-03-07 14:22 UTC: 3 x SKU-991 at $19.99, 1 x SKU-107 at $4.50; total $64.47 "
    "incl. 8.25% tax. Tracking 1Z999AA10123456784.",
)
QUERIES = (
    "how do search engines rank documents",
    "flood damage to crops",
    "MIT licence warranty",
    "sort a list in python",
    "periodic table history",
    "what is photosynthesis",
    "sql group by having",
    "hello",
    "Fuchs",
    "🚀",
)


def broad_corpus() -> list[str]:
    """Queries, each passage, each passage's sentences, passages joined into long texts of 140
    words (~200-256 MiniLM tokens: near the maximum length) and 400 (truncated), and seeded
    mixed-length word soup."""
    pieces = [s.strip() + "." for p in PASSAGES for s in p.split(". ") if len(s.split()) > 3]
    joined = " ".join(PASSAGES).split()
    starts = range(0, len(joined), len(joined) // 5)
    long = [" ".join((joined * 2)[start : start + words]) for words in (140, 400) for start in starts]
    return [*QUERIES, *PASSAGES, *pieces, *long, *sentences(16, max_words=300, seed=5)]
