"""bench.answer runs its child on this checkout and reports each round's CPU milliseconds (a benchmark:
no figure is asserted, only that it measures and reports)."""

from __future__ import annotations

import json

from encoderd.bench import answer


def test_a_round_reports_the_rows_and_the_end_of_an_answer(tmp_path, capsys):
    out = tmp_path / "answer.json"
    # 130 inputs in results of 64 rows: the last result is short, as a call's last batch may be.
    assert answer.main(["--inputs", "130", "--width", "8", "--repeats", "3", "--rounds", "1", "--json", str(out)]) == 0
    (round_,) = json.loads(out.read_text())
    rows_ms, end_ms = round_["this checkout"]
    assert rows_ms >= 0 and end_ms >= 0
    assert "this checkout rows / end" in capsys.readouterr().out
