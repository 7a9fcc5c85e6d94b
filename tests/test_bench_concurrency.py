"""The concurrency bench: its rows keep the best round of each column, and the in-process
run answers every turn of every session, the ratios made of its own figures; the paste
bench's row measures the streaming reply within the paste's wait."""

from __future__ import annotations

from kvchat.bench.concurrency import _best, in_process
from kvchat.bench.paste import meanwhile


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


def test_a_paste_row_counts_the_streaming_replys_waits_within_the_pastes_own():
    # pieces at 0, 1, 2 (a stall), 5.5, 6, 7; the paste waited from 1.5 to 6.5
    row = meanwhile([0.0, 1.0, 2.0, 5.5, 6.0, 7.0], start=1.5, end=6.5)
    assert row == {
        "longest_wait_s": 3.5,  # 2.0 to 5.5
        "pieces_meanwhile": 3,  # 2.0, 5.5, 6.0
        "paste_ttft_s": 5.0,
        "reply_ended_first": False,
    }
    # a stall across the whole span counts the span, not the gap's ends outside it
    assert meanwhile([0.0, 10.0], start=1.0, end=4.0)["longest_wait_s"] == 3.0
    # a reply that ended before the paste's first token says so
    ended = meanwhile([0.0, 0.5, 1.0], start=0.8, end=3.0)
    assert ended["reply_ended_first"] and ended["pieces_meanwhile"] == 1
