"""The fixed calibration set of the start-up fidelity self-check (workers/fidelity.py).

Texts of the shapes real traffic has, each chosen because engines tend to fail on it differently:
short queries (a handful of tokens, where the special tokens dominate), prose, passages longer
than the model's maximum length (cut at spec.max_length: the longest attention and the largest
activations), source code and markup (unusual token statistics), several scripts (CJK, Arabic,
Cyrillic, Devanagari, Greek, Hangul, Thai: rare and byte-fallback tokens), emoji, and repetitive
text (markdown rules, repeated words: many alike token states, where a reduced-precision sum or
norm drifts most), punctuation wrapped in whitespace (a few tokens, nearly all special: int8 served
'   .   ' furthest from float32 in issue 43's probe), and prose in every length band from a few tokens
to the maximum. Rerankers score (query, passage) pairs of the same material, near-ties among them
(two passages about equally relevant: a reduced-precision score difference swaps them, and their
probabilities sit where sigmoid is steepest).

Inputs are tokenized here, in the worker, from the model's own tokenizer with truncation to
spec.max_length, and batched as the scheduler batches traffic: sorted by length, then cut into
batches of at most BATCH_SIZE inputs and BATCH_TOKENS padded tokens, whose lengths still differ
(padded engines pad them; int8 activation scales are set per batch). Sorting keeps the check
cheap: the long inputs share one batch instead of padding every batch to the maximum length.
Changing anything here changes the reference: bump VERSION.

ColPali / ColQwen2 models are checked on queries (QUERIES and PROSE, as their processor builds
them) and on PAGES: document pages drawn here (lines of text, a table rule, a dark figure) in
portrait, landscape and square shapes, so ColQwen2 reads each at a different resolution.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer

from .contract.model_spec import ModelKind, ModelSpec
from .contract.protocol import MediaBatch, TokenBatch

VERSION = 4
BATCH_SIZE = 8  # most inputs per batch
BATCH_TOKENS = 1024  # most padded tokens (size x longest) per batch, unless one input is longer

QUERIES = (
    "capital of australia",
    "how do I reset my router",
    "symptoms of vitamin d deficiency",
    "best way to learn linear algebra",
    "python sort list of dicts by key",
    "why is the sky blue",
    "cheap flights to lisbon in may",
    "what does a cross-encoder do",
)

PROSE = (
    "The bridge was closed for repairs through the winter, so the ferry ran twice as often and the "
    "morning crossing filled with commuters holding coffee against the cold.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen; the light reactions "
    "happen in the thylakoid membranes, the Calvin cycle in the stroma.",
    "Our quarterly revenue grew 4.2% year over year to $18.7M, while operating expenses fell after the "
    "consolidation of two data centres in Q3.",
    'THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT '
    "NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT.",
    "She kept the letters in a biscuit tin under the stairs: forty years of birthdays, two wars, one "
    "long argument about a dog, and a recipe for plum jam nobody ever made again.",
    "To replace the filter, switch the unit off at the wall, unclip the front grille, slide the old "
    "cartridge out and push the new one in until it clicks.",
)

CODE = (
    "def merge(intervals):\n    intervals.sort(key=lambda iv: iv[0])\n    out = [intervals[0]]\n"
    "    for lo, hi in intervals[1:]:\n        if lo <= out[-1][1]:\n            out[-1][1] = max(out[-1][1], hi)\n"
    "        else:\n            out.append([lo, hi])\n    return out",
    "SELECT c.name, COUNT(o.id) AS orders FROM customers c LEFT JOIN orders o ON o.customer_id = c.id "
    "WHERE o.created_at >= '2024-01-01' GROUP BY c.name HAVING COUNT(o.id) > 3 ORDER BY orders DESC;",
    '#include <stdio.h>\nint main(void) { for (int i = 0; i < 10; ++i) printf("%d\\n", i * i); return 0; }',
    '<div class="card"><h2>{{ title }}</h2><p>{{ body | truncate(120) }}</p></div>',
)

MULTILINGUAL = (
    "东京是日本的首都，也是世界上人口最多的都市圈之一。",  # noqa: RUF001 - real Chinese punctuation, on purpose
    "猫はこたつの中で丸くなって眠っている。",
    "القاهرة هي عاصمة مصر وأكبر مدنها، وتقع على ضفاف نهر النيل.",
    "Москва — столица России, крупнейший по численности населения город страны.",
    "भारत की राजधानी नई दिल्ली है और यह यमुना नदी के किनारे स्थित है।",
    "Η Αθήνα είναι η πρωτεύουσα της Ελλάδας και μία από τις αρχαιότερες πόλεις του κόσμου.",  # noqa: RUF001 - Greek
    "서울은 대한민국의 수도이며 한강이 도시를 가로질러 흐른다.",
    "กรุงเทพมหานครเป็นเมืองหลวงของประเทศไทย",
    "Die Straßenbahn fährt heute wegen Bauarbeiten nur bis zur Haltestelle Müllerstraße.",
    "¿Dónde está la estación de tren más cercana? Necesito llegar a Sevilla antes del mediodía.",
)

EMOJI = (
    "great pizza 🍕🍕 but the service 😤😤 two stars ⭐⭐",
    "🚀 launch day! thanks team 🙌🎉 #shipit",
    "🌧️☔️ → 🌈",
)

# Low-entropy inputs that real document chunks hold (table rules, separators, repeated words).
REPEATED = (
    "-" * 600,
    "! " * 200,
    "word " * 600,
    "=" * 300 + " title " + "=" * 300,
    "}} " * 60,  # VERSION 3: int8 with unsmoothed down-projections served these at 0.985-0.989
    "." * 240,
    "?" * 20,
)

# VERSION 4: a few tokens, nearly all of them special, around whitespace (issue 43: int8 0.9930 on '   .   ').
SPARSE = (
    "  .  ",
    " , ",
    "\t;\t",
    "\n.\n",
    " - - - ",
    "  !  ?  ",
    "    word    ",
    "a",
    "..",
    "lol " * 30,
    "1" * 100,
    "~" * 50,
)

# Rerank queries; every query is paired with every passage of PAIR_PASSAGES, relevant or not.
PAIR_QUERIES = (
    "how does photosynthesis work",
    "merge overlapping intervals in python",
    "what is the capital of egypt",
    "software licence warranty disclaimer",
)


def _long_passage(rotation: int) -> str:
    """Every prose, code and multilingual text, in a rotated order."""
    pieces = PROSE + CODE + MULTILINGUAL
    shift = rotation % len(pieces)
    return "\n\n".join(pieces[shift:] + pieces[:shift])


def long_passages(tokenizer, max_length: int, count: int = 2) -> list[str]:
    """`count` passages longer than max_length tokens (rotations repeated as often as needed),
    so truncation always bites."""
    counter = Tokenizer.from_str(tokenizer.to_str())
    counter.no_truncation()
    passages = []
    for rotation in range(count):
        one = _long_passage(rotation * 7)
        repeats = max_length // max(1, len(counter.encode(one).ids)) + 1
        passages.append("\n\n".join([one] * repeats))
    return passages


# VERSION 4: (query, passage, passage) where both passages answer the query about equally well.
NEAR_TIES = (
    (
        "how does photosynthesis work",
        "Plants turn light, water and carbon dioxide into sugar and oxygen.",
        "In photosynthesis, light energy drives the making of glucose from water and CO2.",
    ),
    (
        "reset a home router",
        "Hold the reset button on the back of the router for ten seconds.",
        "To factory-reset your router, press and hold its reset pin until the lights blink.",
    ),
    (
        "capital of egypt",
        "Cairo is the capital of Egypt.",
        "Egypt's capital city is Cairo, on the Nile.",
    ),
    (
        "sort a list in python",
        "list.sort() sorts a list in place.",
        "sorted(items) returns a new sorted list.",
    ),
)


def length_bands(tokenizer, max_length: int) -> list[str]:
    """Prose of about 1/8, 1/4, 1/2 and 3/4 of max_length tokens (VERSION 4): every band between the
    short texts and the passages cut at the maximum."""
    counter = Tokenizer.from_str(tokenizer.to_str())
    counter.no_truncation()
    words = _long_passage(3).split(" ")
    bands = []
    for share in (8, 4, 2):
        target, size = max(4, max_length // share), 4
        while size < len(words) and len(counter.encode(" ".join(words[:size])).ids) < target:
            size += 4
        bands.append(" ".join(words[:size]))
    target, size = max_length * 3 // 4, 4
    while size < len(words) and len(counter.encode(" ".join(words[:size])).ids) < target:
        size += 4
    return [*bands, " ".join(words[:size])]


def texts(tokenizer, max_length: int) -> list[str]:
    """The single-text inputs (embedding and classifier models)."""
    return [
        *QUERIES,
        *PROSE,
        *CODE,
        *MULTILINGUAL,
        *EMOJI,
        *REPEATED,
        *SPARSE,
        *length_bands(tokenizer, max_length),
        *long_passages(tokenizer, max_length),
    ]


def pairs(tokenizer, max_length: int) -> list[tuple[str, str]]:
    """(query, passage) pairs for rerankers: each query against relevant and unrelated passages,
    two of them against a passage cut at the maximum length; near-ties, and queries against
    whitespace, repetitive and mid-length passages (VERSION 4)."""
    passages = [PROSE[1], CODE[0], MULTILINGUAL[2], PROSE[3], PROSE[0], EMOJI[0]]
    long = long_passages(tokenizer, max_length, count=1)[0]
    ties = [(query, passage) for query, *both in NEAR_TIES for passage in both]
    odd = [SPARSE[0], SPARSE[6], REPEATED[2], REPEATED[5], *length_bands(tokenizer, max_length)[1:3]]
    return [
        *((query, passage) for query in PAIR_QUERIES for passage in passages),
        *((query, long) for query in PAIR_QUERIES[:2]),
        *ties,
        *((query, passage) for query in PAIR_QUERIES[:2] for passage in odd),
        (SPARSE[0], SPARSE[0]),
        (QUERIES[0], QUERIES[0]),
    ]


# Document pages: (width, height) and the lines written on them.
PAGES = (
    ((320, 416), PROSE[:3]),
    ((448, 256), (PROSE[2], "Q3 revenue   $18.7M   +4.2%", "Q2 revenue   $17.9M   +3.1%")),
    ((224, 224), (QUERIES[0], CODE[0].splitlines()[0])),
)


def pages() -> list:
    """The calibration pages as PIL images: black text on white, a rule and a grey figure."""
    from PIL import Image, ImageDraw

    drawn = []
    for (width, height), lines in PAGES:
        page = Image.new("RGB", (width, height), "white")
        draw = ImageDraw.Draw(page)
        y = 8
        for line in lines:
            for start in range(0, len(line), max(8, width // 7)):  # the default font is ~6 px a character
                draw.text((8, y), line[start : start + max(8, width // 7)], fill="black")
                y += 12
        draw.line((8, y + 4, width - 8, y + 4), fill="black", width=2)
        draw.rectangle((width // 4, y + 12, 3 * width // 4, min(height - 8, y + 12 + height // 4)), fill=(90, 90, 90))
        drawn.append(page)
    return drawn


def retrieval_queries() -> list[str]:
    return [*QUERIES, *PROSE]


def retrieval_query_batch(processor, queries: list[str]) -> TokenBatch:
    """The queries as the frontend sends them: the token ids the processor builds, one batch."""
    return TokenBatch.from_sequences(-1, [processor(text=[q])["input_ids"][0].numpy() for q in queries])


def retrieval_page_batch(processor, images: list) -> MediaBatch:
    """The pages as the frontend sends them (server/models/retrieval.py, batching.pack_media): pixels
    (ColQwen2: patch rows and grids) and the token sequence built around each, one batch."""
    built = [processor(images=[image]) for image in images]
    tokens = TokenBatch.from_sequences(-1, [b["input_ids"][0].numpy() for b in built])
    pixels = [b["pixel_values"][0].float().numpy() for b in built]
    grids = [b["image_grid_thw"][0].numpy() for b in built if "image_grid_thw" in b]
    features = np.concatenate(pixels) if grids else np.stack(pixels)
    return MediaBatch(
        -1,
        "image",
        features,
        token_ids=tokens.input_ids,
        token_cu=tokens.cu_seqlens,
        grids=np.stack(grids).astype(np.int32) if grids else None,
    )


def batches(spec: ModelSpec, batch_size: int = BATCH_SIZE, trust_remote_code: bool = False) -> list[TokenBatch]:
    """The calibration set of this model, tokenized as requests are and cut into batches of at most
    `batch_size` (no more than the backend accepts: TensorRT profiles end at --batch-size)."""
    from .contract.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(spec.path, spec.lowercase, trust_remote_code)
    inputs = pairs(tokenizer, spec.max_length) if spec.kind == ModelKind.RERANKER else texts(tokenizer, spec.max_length)
    return batches_of(spec, tokenizer, inputs, batch_size)


def batches_of(spec: ModelSpec, tokenizer: Tokenizer, inputs: list, batch_size: int = BATCH_SIZE) -> list[TokenBatch]:
    """`inputs` (texts, or pairs for a reranker) tokenized and batched as the calibration set is
    (bench/fidelity_holdout.py measures other texts the same way)."""
    tokenizer.no_padding()
    tokenizer.enable_truncation(spec.max_length)
    encodings = tokenizer.encode_batch(inputs)
    encodings.sort(key=lambda e: len(e.ids))  # stable: a fixed order for a given tokenizer
    ids = [np.asarray(e.ids, dtype=np.int32) for e in encodings]
    types = [np.asarray(e.type_ids, dtype=np.int32) for e in encodings] if spec.kind == ModelKind.RERANKER else None
    return [
        TokenBatch.from_sequences(-1, [ids[i] for i in rows], None if types is None else [types[i] for i in rows])
        for rows in _batch_rows([len(i) for i in ids], min(batch_size, BATCH_SIZE))
    ]


def _batch_rows(lengths: list[int], batch_size: int) -> list[range]:
    """Consecutive rows of length-sorted inputs, cut where a batch would exceed batch_size
    inputs or BATCH_TOKENS padded tokens (the scheduler's padded budget, scaled down)."""
    batches, start = [], 0
    for end in range(1, len(lengths) + 1):
        if end - start > max(1, batch_size) or (end - start > 1 and (end - start) * lengths[end - 1] > BATCH_TOKENS):
            batches.append(range(start, end - 1))
            start = end - 1
    return [*batches, range(start, len(lengths))] if lengths else []
