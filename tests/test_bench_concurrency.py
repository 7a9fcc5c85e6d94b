"""The concurrency bench: its rows keep the best round of each column, and the in-process
run answers every turn of every session, the ratios made of its own figures."""

from __future__ import annotations

from kvchat.bench.concurrency import _best, in_process


def test_a_row_keeps_the_best_of_each_column():
    first = {"aggregate_tps": 10.0, "turn2_ttft_median_s": 0.5, "seconds": 4.0, "clients": 2}
    second = {"aggregate_tps": 12.0, "turn2_ttft_median_s": 0.7, "seconds": 3.5, "clients": 2}
    assert _best(first, second) == {
        "aggregate_tps": 12.0,
        "turn2_ttft_median_s": 0.5,
        "seconds": 3.5,
        "clients": 2,
    }
    assert _best(None, first) == first


def test_in_process_compares_sessions_together_with_one_alone(demo_model):
    result = in_process("demo", sessions=3, first_tokens=30, max_tokens=4, rounds=2)
    alone, together = result["alone"], result["together"]
    assert (result["sessions"], result["rounds"]) == (3, 2)
    # every turn ran to its length (the demo model is told to ignore its end token)
    assert result["generated_tokens"] == {"alone": [4, 4], "together": [12, 12]}
    assert alone["aggregate_tps"] > 0 and together["aggregate_tps"] > 0
    assert result["aggregate_ratio"] == round(together["aggregate_tps"] / alone["aggregate_tps"], 2)
    assert result["ttft_ratio"] == round(together["ttft_median_s"] / alone["ttft_s"], 2)
    # decode: each reply's 4 tokens over its decoding time, summed over the 3 together;
    # every reply's decoding is shorter than the turn, so above the end-to-end figure
    assert together["decode_tps"] > together["aggregate_tps"] > 0
    assert alone["decode_tps"] > alone["aggregate_tps"] > 0
    assert result["decode_ratio"] == round(together["decode_tps"] / alone["decode_tps"], 2)
