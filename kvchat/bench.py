"""``kvchat bench``: what the live prompt cache buys, measured side by side in one run.

Every figure is measured with the cache and without it in the same process and
the same run, so the ratios hold on a noisy machine even where the absolute
seconds do not. Sections:

1. **classic**: turn 1 hands over a long article, turn 2 asks for a summary;
   each turn's prompt evaluation with the cache and from an empty cache.
2. **sweep**: a ~30-token follow-up after histories of 512 … 8k tokens: time to
   first token with the cache, without it, and the cost of evaluating only the
   new tokens; plus a **profile** of the cached turn (render, prefix search,
   prefill, first token) and its share of the time to first token.
3. **kinds**: every cache kind at 2k history: bytes per token, TTFT, generation
   speed and how many of 64 greedy tokens agree with ``standard``.
4. **persistence**: save and load seconds, file size, and the first turn after
   a resume against a full re-prefill.
5. **blas**: prefill speed with the optimised BLAS and without it (one
   subprocess each, since the BLAS is chosen when mlx is first imported).

:func:`run_bench` returns a plain dict (what ``--json`` prints);
:func:`to_markdown` and :func:`print_tables` render it. No Textual here.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from importlib.metadata import version as package_version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kvchat
from kvchat import blas

if TYPE_CHECKING:
    from kvchat.engine.model import LoadedModel
    from kvchat.engine.session import Session

DEFAULT_MODEL = "demo:qwen2.5-0.5b"
CORPUS = Path(__file__).parent / "engine" / "demo_corpus.txt"
KINDS = ("standard", "quantized:8", "quantized:4", "rotating:1024", "chunked:1024", "concatenate")

READ_PROMPT = "Please read the following article carefully. I will ask you about it next.\n\n"
SUMMARY_PROMPT = "Summarize the article"
FOLLOW_UP = (
    "Thanks. Looking back over everything above, which three details matter most, "
    "and why would the keeper bother to write them down?"
)

Log = Callable[[str], None]


def _plan(quick: bool) -> dict[str, Any]:
    """Sizes of every experiment; ``quick`` keeps the whole run small."""
    return {
        "article_tokens": 2000 if quick else 4500,
        "classic_max_tokens": 16 if quick else 24,
        "sweep": [512, 1024, 2048] if quick else [512, 1024, 2048, 4096, 8192],
        "follow_max_tokens": 8 if quick else 6,
        # turn 1 starts from an empty cache, so "with" and "without" are the same work:
        # the full run measures it once to stay within its time budget
        "classic_turn1_twice": quick,
        "cached_repeats": 3,
        "kinds_history": 2048,
        "kinds": list(KINDS),
        "agree_tokens": 64,
        "persist_at": [2048, 4096],
        "blas_probe_tokens": 32 if quick else 64,
        "profile_repeats": 3,
    }


# ------------------------------------------------------------------ machine


def machine() -> dict[str, Any]:
    """What the report runs on: CPU, cores, memory, mlx and its device, the BLAS."""
    import mlx.core as mx

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    load = None
    with contextlib.suppress(OSError, AttributeError):
        load = [round(x, 2) for x in os.getloadavg()]
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": package_version("mlx-lm"),
        "device": "gpu" if mx.default_device() == mx.gpu else "cpu",
        "blas": blas.describe(),
        "kvchat": kvchat.__version__,
        "load_average_at_start": load,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


# ------------------------------------------------------------------ text


def _paragraphs() -> list[str]:
    text = CORPUS.read_text(encoding="utf-8")
    return [p.strip() for p in text.split("\n\n") if len(p.strip()) > 40]


def make_text(tokenizer, tokens: int, seed: int) -> str:
    """Deterministic English-like text of about ``tokens`` tokens (corpus paragraphs, shuffled)."""
    paragraphs = _paragraphs()
    rng = random.Random(seed)
    out: list[str] = []
    count = 0
    while count < tokens:
        order = list(paragraphs)
        rng.shuffle(order)
        for p in order:
            n = len(tokenizer.encode(p + "\n\n", add_special_tokens=False))
            if count + n > tokens and out:
                # finish with part of a paragraph, cut at a word, to land close to the target
                words = p.split()
                lo, hi = 1, len(words)
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    m = len(tokenizer.encode(" ".join(words[:mid]), add_special_tokens=False))
                    lo, hi = (mid, hi) if count + m <= tokens else (lo, mid - 1)
                out.append(" ".join(words[:lo]))
                return "\n\n".join(out)
            out.append(p)
            count += n
            if count >= tokens:
                break
    return "\n\n".join(out)


# ------------------------------------------------------------------ helpers


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0 or not math.isfinite(a) or not math.isfinite(b):
        return None
    return a / b


def run_turn(session: Session, text: str) -> dict[str, Any]:
    """Send ``text``, drain the reply; return the stats as a dict plus the reply's token ids."""
    from kvchat.engine.session import TurnDone

    done = None
    for event in session.send(text):
        if isinstance(event, TurnDone):
            done = event
    assert done is not None
    stats = done.stats.to_dict()
    start = stats["prompt_tokens"]
    tokens = list(session.ledger[start : start + stats["generated_tokens"]])
    if len(tokens) != stats["generated_tokens"]:  # the ledger was cut (bounded kinds)
        tokens = list(session.lm.tokenizer.encode(done.reply, add_special_tokens=False))
    stats["tokens"] = tokens
    stats["reply"] = done.reply
    return stats


def bytes_per_token(cache: list[Any]) -> float:
    """Bytes one token takes across all layers: each layer's key and value buffers divided
    by the token slots they have (preallocated slots cost the same as used ones), so the
    figure is exact for standard, quantized and bounded kinds alike."""
    from mlx.utils import tree_flatten

    total = 0.0
    for layer in cache:
        arrays = [v for _, v in tree_flatten(layer.state) if hasattr(v, "nbytes")]
        if not arrays or arrays[0].ndim < 2 or arrays[0].shape[-2] == 0:
            continue
        total += sum(a.nbytes for a in arrays) / arrays[0].shape[-2]
    return total


def _eval_only_s(lm: LoadedModel, tokens: list[int]) -> float:
    """Seconds to evaluate only ``tokens`` from an empty cache and sample the first token."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    from kvchat.engine.kinds import make_cache, parse_kind

    cache = make_cache(lm.model, parse_kind("standard"))
    start = time.perf_counter()
    with mx.stream(generation_stream):
        if len(tokens) > 1:
            lm.model(mx.array(tokens[:-1])[None], cache=cache)
            mx.eval([c.state for c in cache])
        logits = lm.model(mx.array(tokens[-1:])[None], cache=cache)
        int(mx.argmax(logits[0, -1]).item())
    return time.perf_counter() - start


@contextlib.contextmanager
def temp_home() -> Iterator[Path]:
    """A temporary ``KVCHAT_HOME``, so the user's saved sessions are never touched."""
    old = os.environ.get("KVCHAT_HOME")
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-") as tmp:
        os.environ["KVCHAT_HOME"] = tmp
        try:
            yield Path(tmp)
        finally:
            if old is None:
                os.environ.pop("KVCHAT_HOME", None)
            else:
                os.environ["KVCHAT_HOME"] = old


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


# ------------------------------------------------------------------ profile


def profile_cached_turn(session: Session, text: str) -> dict[str, float]:
    """Split one cached turn's time to first token into its parts, outside the Session.

    Mirrors ``Session._run_turn``: render the transcript through the chat
    template (tokenising included), search the common prefix with the ledger
    and trim the cache to it, prefill the new tokens but the last, then feed the
    last one and sample the first reply token. Leaves the session as it found it.
    """
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from kvchat.engine.kinds import trim_to
    from kvchat.engine.session import common_prefix

    history = list(session.messages)
    messages = [*history, {"role": "user", "content": text}]
    t0 = time.perf_counter()
    prompt = session.render(messages, True)
    t1 = time.perf_counter()
    n = min(common_prefix(session.ledger, prompt), len(prompt) - 1)
    t2 = time.perf_counter()
    if n < len(session.ledger):
        assert trim_to(session.cache, n), "the profile needs a trimmable cache"
        session.ledger = session.ledger[:n]
    t3 = time.perf_counter()
    for _ in session._prefill(prompt[n:-1], total=len(prompt) - n):
        pass
    t4 = time.perf_counter()
    sampler = make_sampler(temp=0.0)
    gen = generate_step(
        mx.array(prompt[-1:]), session.lm.model, prompt_cache=session.cache,
        sampler=sampler, max_tokens=2,
    )
    first, _ = next(gen)
    t5 = time.perf_counter()
    gen.close()
    mx.eval([c.state for c in session.cache])
    # the cache now holds the prompt and the first token; put the session back
    session.ledger = [*prompt, int(first)]
    session.messages = history
    session.sync()
    return {
        "render_s": t1 - t0,
        "prefix_search_s": t2 - t1,
        "trim_s": t3 - t2,
        "prefill_s": t4 - t3,
        "first_token_s": t5 - t4,
        "new_tokens": len(prompt) - n,
        "history_tokens": n,
    }


PROFILE_PARTS = {
    "render_s": "tokenising + chat template (whole transcript)",
    "prefix_search_s": "prefix search against the ledger",
    "trim_s": "trim the cache to the prefix",
    "prefill_s": "prefill of the new tokens (all but the last)",
    "first_token_s": "last prompt token + first sampled token",
}


def _median_profile(profiles: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: _median([p[k] for p in profiles]) for k in PROFILE_PARTS}
    total = sum(out[k] for k in PROFILE_PARTS)
    out["total_s"] = total
    out["shares"] = {k: (out[k] / total if total > 0 else 0.0) for k in PROFILE_PARTS}
    out["new_tokens"] = profiles[0]["new_tokens"]
    out["history_tokens"] = profiles[0]["history_tokens"]
    slowest = max(PROFILE_PARTS, key=lambda k: out[k])
    out["slowest"] = slowest
    return out


# ------------------------------------------------------------------ experiments


class Bench:
    def __init__(self, lm: LoadedModel, quick: bool, log: Log | None = None):
        self.lm = lm
        self.quick = quick
        self.plan = _plan(quick)
        self.log = log or (lambda _msg: None)
        self.histories: dict[int, list[dict]] = {}
        self.sessions: dict[int, Session] = {}
        self.started = time.perf_counter()

    def _say(self, msg: str) -> None:
        self.log(f"[{time.perf_counter() - self.started:7.1f}s] {msg}")

    def _session(self, messages: list[dict] | None = None, max_tokens: int = 8, kind: str = "standard"):
        from kvchat.engine.session import GenerationSettings, Session

        return Session(
            self.lm, kind=kind, messages=list(messages or []),
            settings=GenerationSettings(max_tokens=max_tokens, temp=0.0),
        )

    # 1 ------------------------------------------------------------ classic
    def classic(self) -> dict[str, Any]:
        plan = self.plan
        tok = self.lm.tokenizer
        article = make_text(tok, plan["article_tokens"], seed=1)
        first = READ_PROMPT + article
        self._say(f"classic: turn 1 ({plan['article_tokens']} token article), with the cache")
        a = self._session(max_tokens=plan["classic_max_tokens"])
        t1_cached = run_turn(a, first)
        if plan["classic_turn1_twice"]:
            self._say("classic: turn 1 again from an empty cache")
            b = self._session(max_tokens=plan["classic_max_tokens"])
            b.reset()
            t1_fresh = run_turn(b, first)
        else:
            t1_fresh = t1_cached
        self._say("classic: turn 2 with the cache")
        t2_cached = run_turn(a, SUMMARY_PROMPT)
        self._say("classic: turn 2 from an empty cache (same transcript, full prefill)")
        a.undo()
        a.reset()
        t2_fresh = run_turn(a, SUMMARY_PROMPT)
        turns = []
        for i, (c, u) in enumerate(((t1_cached, t1_fresh), (t2_cached, t2_fresh)), 1):
            turns.append({
                "turn": i,
                "message": "read this article" if i == 1 else SUMMARY_PROMPT,
                "prompt_tokens": c["prompt_tokens"],
                "cached": _turn_view(c),
                "uncached": _turn_view(u),
                "speedup_prompt_eval": _ratio(u["prompt_eval_s"], c["prompt_eval_s"]),
                "speedup_ttft": _ratio(u["ttft_s"], c["ttft_s"]),
                "same_reply": c["tokens"] == u["tokens"],
            })
        return {"article_tokens": len(tok.encode(article, add_special_tokens=False)), "turns": turns}

    # 2 + 4 -------------------------------------------------- sweep, persistence
    def _grow(self, history: list[dict], target: int, seed: int) -> list[dict]:
        """Append synthetic exchanges until the transcript renders to about ``target`` tokens."""
        render = self._session().render
        history = list(history)
        have = len(render(history, False))
        while have < target - 16:
            need = target - have
            reply = make_text(self.lm.tokenizer, min(40, max(4, need // 8)), seed=seed + 1000)
            probe = [*history, {"role": "user", "content": "x"}, {"role": "assistant", "content": reply}]
            overhead = len(render(probe, False)) - have
            body = max(4, need - overhead)
            user = make_text(self.lm.tokenizer, body, seed=seed)
            history += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
            have = len(render(history, False))
            seed += 1
        return history

    def sweep(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Follow-up TTFT after each history length, with the cache and from an empty one.

        The histories are prefixes of one transcript (fillers, then the follow-up
        and a fixed reply at each length). The uncached figures come from **one
        fresh full prefill** of that transcript, timed up to the end of each
        follow-up's prompt, where it samples the first token: exactly the work
        a fresh prefill of that prompt does (chunk edges aside), so the longest
        history is evaluated once rather than once per length. At each
        checkpoint a copy of the cache, cut back to the history, becomes a
        Session for the cached measurements.
        """
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        from kvchat.engine.kinds import make_cache, parse_kind, trim_to
        from kvchat.engine.session import copy_cache

        plan = self.plan
        render = self._session().render
        checkpoints = []
        messages: list[dict] = []
        for i, target in enumerate(plan["sweep"]):
            messages = self._grow(messages, target, seed=100 + 10 * i)
            history = list(messages)
            self.histories[target] = history
            checkpoints.append((target, history))
            reply = make_text(self.lm.tokenizer, 24, seed=900 + i)
            messages = [*history, {"role": "user", "content": FOLLOW_UP},
                        {"role": "assistant", "content": reply}]
        transcript = render(messages, False)

        points, persists = [], []
        cache = make_cache(self.lm.model, parse_kind("standard"))
        done, clock = 0, 0.0
        step = max(1, self._session().settings.prefill_step)
        for target, history in checkpoints:
            t0 = time.perf_counter()
            prompt = render([*history, {"role": "user", "content": FOLLOW_UP}], True)
            render_s = time.perf_counter() - t0
            if transcript[: len(prompt)] != prompt:
                raise RuntimeError("the follow-up prompt is not a prefix of the transcript")
            self._say(f"sweep {target}: fresh prefill up to {len(prompt)} tokens (no cache)")
            t0 = time.perf_counter()
            with mx.stream(generation_stream):
                for at in range(done, len(prompt) - 1, step):
                    chunk = prompt[at : min(at + step, len(prompt) - 1)]
                    self.lm.model(mx.array(chunk)[None], cache=cache)
                    mx.eval([c.state for c in cache])
                    mx.clear_cache()
                logits = self.lm.model(mx.array(prompt[-1:])[None], cache=cache)
                first_uncached = int(mx.argmax(logits[0, -1]).item())
            clock += time.perf_counter() - t0
            done = len(prompt)
            uncached = {"ttft_s": render_s + clock, "prompt_eval_s": clock,
                        "prompt_tokens": len(prompt)}

            h_tokens = render(history, False)
            copied = copy_cache(cache)
            if not trim_to(copied, len(h_tokens)):
                raise RuntimeError("could not cut the cache copy back to the history")
            from kvchat.engine.session import GenerationSettings, Session

            s = Session.restore(
                self.lm, messages=list(history), kind="standard", ledger=h_tokens, cache=copied,
                settings=GenerationSettings(max_tokens=plan["follow_max_tokens"], temp=0.0),
            )
            if target in plan["persist_at"]:
                persists.append(self._persistence(s, target, uncached, first_uncached))
            self._say(f"sweep {target}: follow-up with the cache (x{plan['cached_repeats']})")
            cached_runs = []
            for _ in range(plan["cached_repeats"]):
                cached_runs.append(run_turn(s, FOLLOW_UP))
                s.undo()
            cached_med = _median([r["ttft_s"] for r in cached_runs])
            new = prompt[cached_runs[0]["reused_tokens"]:]
            eval_only = _median([_eval_only_s(self.lm, new) for _ in range(plan["cached_repeats"])])
            self._say(f"sweep {target}: profile of the cached turn")
            profile = _median_profile(
                [profile_cached_turn(s, FOLLOW_UP) for _ in range(plan["profile_repeats"])]
            )
            points.append({
                "target_tokens": target,
                "history_tokens": len(h_tokens),
                "new_tokens": cached_runs[0]["evaluated_tokens"],
                "cached_ttft_s": cached_med,
                "cached_ttft_best_s": min(r["ttft_s"] for r in cached_runs),
                "cached_prompt_eval_s": _median([r["prompt_eval_s"] for r in cached_runs]),
                "uncached_ttft_s": uncached["ttft_s"],
                "uncached_prompt_eval_s": uncached["prompt_eval_s"],
                "uncached_prompt_tokens": len(prompt),
                "speedup_ttft": _ratio(uncached["ttft_s"], cached_med),
                "eval_new_only_s": eval_only,
                "cached_over_new_only": _ratio(cached_med, eval_only),
                "gen_tps_cached": _median([r["gen_tps"] for r in cached_runs]),
                # greedy: the cached turn's first token equals the fresh prefill's
                "same_reply": all(r["tokens"][:1] == [first_uncached] for r in cached_runs),
                "profile": profile,
            })
            if target == plan["kinds_history"]:
                self.sessions[target] = s
            del s, copied
        del cache
        mx.clear_cache()
        return {"follow_up": FOLLOW_UP, "uncached_method": "one fresh prefill, timed per prompt",
                "points": points}, {"points": persists}

    def _persistence(
        self, s: Session, target: int, uncached: dict[str, Any], first_uncached: int
    ) -> dict[str, Any]:
        import mlx.core as mx

        from kvchat import store

        self._say(f"persistence {target}: save, load, first turn after resume")
        name = f"bench-{target}"
        with temp_home():
            t0 = time.perf_counter()
            folder = store.save(s, name)
            save_s = time.perf_counter() - t0
            size = _folder_bytes(folder)
            cache_file = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
            t0 = time.perf_counter()
            loaded = store.load(name, self.lm)
            mx.eval([c.state for c in loaded.session.cache])  # arrays in memory, not lazily mapped
            load_s = time.perf_counter() - t0
            resumed = run_turn(loaded.session, FOLLOW_UP)
        return {
            "target_tokens": target,
            "history_tokens": len(s.ledger),
            "save_s": save_s,
            "load_s": load_s,
            "folder_bytes": size,
            "cache_file_bytes": cache_file,
            "resumed_from_disk": loaded.resumed_from_disk,
            "notice": loaded.notice,
            "resumed_reused_tokens": resumed["reused_tokens"],
            "resumed_ttft_s": resumed["ttft_s"],
            "resumed_prompt_eval_s": resumed["prompt_eval_s"],
            "reprefill_ttft_s": uncached["ttft_s"],
            "reprefill_prompt_eval_s": uncached["prompt_eval_s"],
            "speedup_ttft": _ratio(uncached["ttft_s"], resumed["ttft_s"]),
            "load_plus_turn_speedup": _ratio(uncached["ttft_s"], load_s + resumed["ttft_s"]),
            "same_reply": resumed["tokens"][:1] == [first_uncached],
        }

    # 3 ------------------------------------------------------------ kinds
    def kinds(self) -> dict[str, Any]:
        import mlx.core as mx

        from kvchat.engine.kinds import QUANT_GROUP_SIZE
        from kvchat.engine.session import GenerationSettings

        plan = self.plan
        target = plan["kinds_history"]
        base = self.sessions.get(target)
        history = self.histories.get(target)
        if base is None or history is None:
            history = self._grow([], target, seed=500)
            base = self._session(history)
            base.rebuild("bench")
        rows = []
        reference: list[int] | None = None
        for name in plan["kinds"]:
            self._say(f"kinds: {name} at {target} tokens, {plan['agree_tokens']} greedy tokens")
            child = base.fork_prefix(history)
            child.settings = GenerationSettings(max_tokens=plan["agree_tokens"], temp=0.0)
            t0 = time.perf_counter()
            rebuilt = child.set_kind(name)
            prepare_s = time.perf_counter() - t0
            bpt_history = bytes_per_token(child.cache)
            r = run_turn(child, FOLLOW_UP)
            if name == "standard":
                reference = r["tokens"]
            ref = reference or []
            agree = sum(1 for x, y in zip(r["tokens"], ref) if x == y)
            first_diff = next(
                (i for i, (x, y) in enumerate(zip(r["tokens"], ref)) if x != y),
                min(len(r["tokens"]), len(ref)),
            )
            rows.append({
                "kind": name,
                "prepared": "rebuilt from the transcript" if rebuilt else "converted / copied",
                "prepare_s": prepare_s,
                "bytes_per_token": bpt_history,
                "cache_bytes_after_turn": r["cache_bytes"],
                "cache_tokens_after_turn": r["cache_tokens"],
                "ttft_s": r["ttft_s"],
                "prompt_eval_s": r["prompt_eval_s"],
                "reused_tokens": r["reused_tokens"],
                "generated_tokens": r["generated_tokens"],
                "gen_tps": r["gen_tps"],
                "agree_with_standard": agree,
                "agree_of": len(ref),
                "first_divergence": first_diff,
                "rebuilt": r["rebuilt"],
            })
            del child
            mx.clear_cache()
        std = next(r for r in rows if r["kind"] == "standard")
        for r in rows:
            r["bytes_vs_standard"] = _ratio(r["bytes_per_token"], std["bytes_per_token"])
        # The same comparison for a 16-bit model: quantize the standard cache's keys
        # and values cast to float16 (scales and biases then take 16 bits too).
        keys16 = {}
        layer = base.cache[0]
        n_tokens = layer.offset
        k, v = layer.keys[..., :n_tokens, :], layer.values[..., :n_tokens, :]
        fp16 = (k.astype(mx.float16).nbytes + v.astype(mx.float16).nbytes) / n_tokens
        for bits in (8, 4):
            q = [mx.quantize(x.astype(mx.float16), group_size=QUANT_GROUP_SIZE, bits=bits) for x in (k, v)]
            qbytes = sum(a.nbytes for pair in q for a in pair) / n_tokens
            keys16[f"quantized:{bits}"] = qbytes / fp16
        layers = len(base.cache)
        return {
            "history_tokens": len(base.ledger),
            "rows": rows,
            "at_16_bit": {
                "standard_bytes_per_token": fp16 * layers,
                "ratios": keys16,
                "how": "standard cache keys/values cast to float16 and quantized (group 64); "
                "computed on layer 0, all layers have the same shape",
            },
        }

    # 5 ------------------------------------------------------------ blas
    def blas(self) -> dict[str, Any]:
        if not sys.platform.startswith("linux"):
            return {"skipped": "not Linux: mlx uses the platform BLAS"}
        out = {}
        for label, off in (("optimised", False), ("reference", True)):
            self._say(f"blas: prefill probe with the {label} BLAS (subprocess)")
            env = dict(os.environ)
            env.pop("KVCHAT_NO_BLAS", None)
            if off:
                env["KVCHAT_NO_BLAS"] = "1"
            cmd = [
                sys.executable, "-m", "kvchat.bench", "--blas-probe",
                "--model", self.lm.model_id, "--tokens", str(self.plan["blas_probe_tokens"]),
            ]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                out[label] = {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
                continue
            out[label] = json.loads(proc.stdout.strip().splitlines()[-1])
        opt, ref = out.get("optimised", {}), out.get("reference", {})
        out["speedup"] = _ratio(opt.get("prefill_tps"), ref.get("prefill_tps"))
        out["matmul_speedup"] = _ratio(opt.get("matmul_gflops"), ref.get("matmul_gflops"))
        return out


def _turn_view(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("prompt_tokens", "reused_tokens", "evaluated_tokens", "prompt_eval_s", "ttft_s",
            "generated_tokens", "gen_tps", "cache_tokens", "cache_bytes")
    return {k: r[k] for k in keys}


def blas_probe(spec: str, tokens: int) -> dict[str, Any]:
    """Prefill speed of ``tokens`` tokens in one pass, and n×n matmul GFLOP/s, in this process."""
    import mlx.core as mx

    from kvchat.engine.kinds import make_cache, parse_kind
    from kvchat.engine.model import load_model

    lm = load_model(spec)
    ids = lm.tokenizer.encode(make_text(lm.tokenizer, tokens + 8, seed=7), add_special_tokens=False)
    ids = (ids * (tokens // max(1, len(ids)) + 1))[:tokens]

    def once(n: int) -> float:
        cache = make_cache(lm.model, parse_kind("standard"))
        start = time.perf_counter()
        mx.eval(lm.model(mx.array(ids[:n])[None], cache=cache))
        return time.perf_counter() - start

    once(8)  # warm up
    times = [once(tokens)]
    while len(times) < 3 and sum(times) < 3.0:
        times.append(once(tokens))
    seconds = min(times)
    n = 512
    a = mx.random.normal((n, n))
    mx.eval(a @ a)
    start = time.perf_counter()
    reps = 0
    while reps < 2 or (time.perf_counter() - start < 0.5 and reps < 50):
        mx.eval(a @ a)
        reps += 1
    gflops = 2 * n**3 * reps / (time.perf_counter() - start) / 1e9
    return {
        "blas": blas.describe(),
        "blas_status": blas.info.status,
        "tokens": tokens,
        "prefill_s": seconds,
        "prefill_tps": tokens / seconds,
        "matmul_gflops": gflops,
    }


# ------------------------------------------------------------------ the run


def run_bench(
    spec: str = DEFAULT_MODEL,
    quick: bool = False,
    log: Log | None = None,
    lm: LoadedModel | None = None,
    load_s: float | None = None,
) -> dict[str, Any]:
    """Run every section on model ``spec``; return all figures as a plain dict.

    Pass ``lm`` (and the seconds it took to load, ``load_s``) to reuse a loaded model.
    """
    from kvchat.engine.model import load_model

    say = log or (lambda _m: None)
    started = time.perf_counter()
    head = machine()
    if lm is None:
        t0 = time.perf_counter()
        lm = load_model(spec)
        load_s = time.perf_counter() - t0
    say(f"model {spec} ready" + (f", loaded in {load_s:.1f}s" if load_s else ""))
    bench = Bench(lm, quick, log)
    result: dict[str, Any] = {
        "machine": head,
        "model": {
            "id": lm.model_id,
            "fingerprint": lm.fingerprint,
            "context_length": lm.context_length,
            "dtype": _model_dtype(lm),
            "parameters": _parameters(lm),
            "load_s": load_s,
        },
        "quick": quick,
        "plan": bench.plan,
    }
    result["classic"] = bench.classic()
    sweep, persistence = bench.sweep()
    result["sweep"] = sweep
    result["persistence"] = persistence
    result["kinds"] = bench.kinds()
    bench.sessions.clear()
    result["blas"] = bench.blas()
    result["profile"] = sweep["points"][-1]["profile"] | {
        "history_tokens": sweep["points"][-1]["history_tokens"],
        "session_ttft_s": sweep["points"][-1]["cached_ttft_s"],
    }
    result["targets"] = targets(result)
    result["total_s"] = time.perf_counter() - started
    with contextlib.suppress(OSError, AttributeError):
        head["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return result


def _model_dtype(lm: LoadedModel) -> str:
    from mlx.utils import tree_flatten

    dtypes = {str(v.dtype) for _, v in tree_flatten(lm.model.parameters())}
    return ", ".join(sorted(d.replace("mlx.core.", "") for d in dtypes))


def _parameters(lm: LoadedModel) -> int:
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(lm.model.parameters()))


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured value and whether it is met."""
    out = []
    t2 = result["classic"]["turns"][1]
    out.append({
        "target": "classic turn 2 prompt eval ≥50× faster with the cache",
        "value": t2["speedup_prompt_eval"], "limit": 50.0, "op": ">=",
    })
    worst = max(result["sweep"]["points"], key=lambda p: p["cached_over_new_only"] or 0)
    out.append({
        "target": "cached turn TTFT ≤2× evaluating only its new tokens (worst history: "
        f"{worst['history_tokens']})",
        "value": worst["cached_over_new_only"], "limit": 2.0, "op": "<=",
    })
    at4k = [p for p in result["persistence"]["points"] if p["target_tokens"] == 4096]
    if at4k:
        out.append({
            "target": "resumed first turn ≥50× faster than a re-prefill at 4k",
            "value": at4k[0]["speedup_ttft"], "limit": 50.0, "op": ">=",
        })
    rows = {r["kind"]: r for r in result["kinds"]["rows"]}
    if "quantized:4" in rows:
        out.append({
            "target": "quantized:4 ≤0.16 of standard bytes/token (32-bit model)",
            "value": rows["quantized:4"]["bytes_vs_standard"], "limit": 0.16, "op": "<=",
        })
        out.append({
            "target": "quantized:4 ≤0.3 of standard bytes/token (16-bit)",
            "value": result["kinds"]["at_16_bit"]["ratios"]["quantized:4"], "limit": 0.3, "op": "<=",
        })
    for t in out:
        v = t["value"]
        t["met"] = v is not None and (v >= t["limit"] if t["op"] == ">=" else v <= t["limit"])
    return out


# ------------------------------------------------------------------ rendering


def _f(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) >= 100:
            return f"{x:,.0f}"
        if abs(x) >= 10:
            return f"{x:.1f}"
        return f"{x:.{digits}g}" if abs(x) < 1 else f"{x:.2f}"
    return str(x)


def _x(x: float | None) -> str:
    return "–" if x is None else f"{x:,.1f}×" if x < 100 else f"{x:,.0f}×"


def _mb(n: float | None) -> str:
    return "–" if n is None else f"{n / 1e6:,.1f} MB"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def tables(result: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]], str | None]]:
    """(title, headers, rows, note) for every section: one source for Markdown and rich."""
    out = []
    c = result["classic"]
    out.append((
        f"Classic: a {c['article_tokens']:,}-token article, then \"{SUMMARY_PROMPT}\"",
        ["turn", "prompt tokens", "evaluated (cache)", "prompt eval, cache (s)",
         "prompt eval, no cache (s)", "speedup", "TTFT cache (s)", "TTFT no cache (s)", "same reply"],
        [[str(t["turn"]), _f(t["prompt_tokens"]), _f(t["cached"]["evaluated_tokens"]),
          _f(t["cached"]["prompt_eval_s"]), _f(t["uncached"]["prompt_eval_s"]),
          _x(t["speedup_prompt_eval"]), _f(t["cached"]["ttft_s"]), _f(t["uncached"]["ttft_s"]),
          _f(t["same_reply"])] for t in c["turns"]],
        "Turn 1 starts from an empty cache either way, so its two columns are the same work ("
        + ("measured twice" if result["plan"]["classic_turn1_twice"] else "measured once, shown in both")
        + "). \"No cache\" is the same transcript after `reset()`: a full prefill.",
    ))
    pts = result["sweep"]["points"]
    out.append((
        "History sweep: a ~30-token follow-up after N tokens of history",
        ["history tokens", "new tokens", "TTFT cache (s)", "TTFT no cache (s)", "speedup",
         "eval new tokens only (s)", "cache ÷ new-only", "same 1st token"],
        [[_f(p["history_tokens"]), _f(p["new_tokens"]), _f(p["cached_ttft_s"]),
          _f(p["uncached_ttft_s"]), _x(p["speedup_ttft"]), _f(p["eval_new_only_s"]),
          _f(p["cached_over_new_only"]), _f(p["same_reply"])] for p in pts],
        "TTFT with the cache is the median of "
        f"{result['plan']['cached_repeats']} runs; \"eval new tokens only\" evaluates just the "
        "turn's new tokens from an empty cache and samples one token (no history at all). "
        "The histories are prefixes of one transcript; \"no cache\" is one fresh full prefill "
        "of it from an empty cache, timed (plus templating) up to each follow-up prompt's last "
        "token and its first sampled token, the work a fresh prefill of that prompt does. "
        "\"Same 1st token\": the cached turn's first token equals the fresh prefill's (greedy).",
    ))
    k = result["kinds"]
    out.append((
        f"Cache kinds at {k['history_tokens']:,} tokens of history",
        ["kind", "bytes/token", "vs standard", "holds tokens", "TTFT (s)", "gen tok/s",
         f"agree of {result['plan']['agree_tokens']}", "first divergence", "prepared by"],
        [[r["kind"], _f(r["bytes_per_token"]), _f(r["bytes_vs_standard"]),
          _f(r["cache_tokens_after_turn"]), _f(r["ttft_s"]),
          _f(r["gen_tps"]), f"{r['agree_with_standard']}/{r['agree_of']}",
          _f(r["first_divergence"]), r["prepared"]] for r in k["rows"]],
        "Bytes per token: each layer's key and value buffers over their token slots, summed "
        "over layers (preallocation slack excluded); \"holds tokens\" is what the cache keeps "
        f"after the turn. The model runs in {result['model']['dtype']}; at 16 bits the standard "
        f"cache would take {_f(k['at_16_bit']['standard_bytes_per_token'])} bytes/token and quantized:8 / "
        f"quantized:4 {_f(k['at_16_bit']['ratios']['quantized:8'])} / "
        f"{_f(k['at_16_bit']['ratios']['quantized:4'])} of it. Rotating and chunked kinds "
        "keep only a window, so they diverge by design; quantized kinds were converted from "
        "the standard cache, the way switching a live session does.",
    ))
    ps = result["persistence"]["points"]
    if ps:
        out.append((
            "Persistence: save, load, and the first turn after a resume",
            ["history tokens", "save (s)", "load (s)", "size", "resumed TTFT (s)",
             "re-prefill TTFT (s)", "speedup", "incl. load", "same 1st token"],
            [[_f(p["history_tokens"]), _f(p["save_s"]), _f(p["load_s"]), _mb(p["folder_bytes"]),
              _f(p["resumed_ttft_s"]), _f(p["reprefill_ttft_s"]), _x(p["speedup_ttft"]),
              _x(p["load_plus_turn_speedup"]), _f(p["same_reply"])] for p in ps],
            "Saved into a temporary KVCHAT_HOME. Load time includes reading every cache array "
            "into memory; \"incl. load\" compares load + first turn with the re-prefill.",
        ))
    p = result["profile"]
    out.append((
        f"Profile of one cached turn ({p['history_tokens']:,} tokens of history, "
        f"{p['new_tokens']} new)",
        ["part", "seconds", "share of TTFT"],
        [[PROFILE_PARTS[key], _f(p[key]), _pct(p["shares"][key])] for key in PROFILE_PARTS]
        + [["total (profiled)", _f(p["total_s"]), "100%"],
           ["TTFT measured by Session (median)", _f(p["session_ttft_s"]), ""]],
        "Each part is the median of "
        f"{result['plan']['profile_repeats']} runs, timed outside the Session with its own helpers.",
    ))
    b = result["blas"]
    if "skipped" not in b:
        rows = []
        for label in ("optimised", "reference"):
            r = b.get(label, {})
            if "error" in r:
                rows.append([label, r["error"], "", "", ""])
            else:
                rows.append([label, r.get("blas", ""), _f(r.get("tokens")), _f(r.get("prefill_tps")),
                             _f(r.get("matmul_gflops"))])
        out.append((
            "BLAS: prefill with the optimised BLAS and without it",
            ["BLAS", "library", "tokens", "prefill tok/s", "matmul GFLOP/s (512²)"],
            rows,
            f"Prefill speedup {_x(b.get('speedup'))}, matmul {_x(b.get('matmul_speedup'))}; "
            "one subprocess each (KVCHAT_NO_BLAS=1 for the reference BLAS).",
        ))
    out.append((
        "Targets",
        ["target", "measured", "limit", "met"],
        [[t["target"], _f(t["value"]), f"{t['op']} {t['limit']}", _f(t["met"])]
         for t in result["targets"]],
        None,
    ))
    return out


def _machine_lines(result: dict[str, Any]) -> list[tuple[str, str]]:
    m, model = result["machine"], result["model"]
    return [
        ("CPU", f"{m['cpu']}, {m['cores']} cores"
         + (f", {m['memory_bytes'] / 2**30:.0f} GiB" if m["memory_bytes"] else "")),
        ("mlx", f"{m['mlx']} (mlx-lm {m['mlx_lm']}), device {m['device']}"),
        ("BLAS", m["blas"]),
        ("platform", f"{m['platform']}, Python {m['python']}, kvchat {m['kvchat']}"),
        ("model", f"{model['id']} ({model['parameters'] / 1e6:,.0f}M parameters, {model['dtype']}, "
         f"fingerprint {model['fingerprint']})"),
        ("run", f"{m['date']}, {'quick' if result['quick'] else 'full'}, "
         f"{result['total_s']:.0f} s, load average (1/5/15 min) at start "
         f"{m['load_average_at_start']}, at end {m.get('load_average_at_end')}"),
    ]


def to_markdown(result: dict[str, Any]) -> str:
    lines = ["# kvchat bench", ""]
    lines += [f"- **{k}**: {v}" for k, v in _machine_lines(result)]
    for title, headers, rows, note in tables(result):
        lines += ["", f"## {title}", "", "| " + " | ".join(headers) + " |",
                  "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
        if note:
            lines += ["", note]
    return "\n".join(lines) + "\n"


def print_tables(result: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    head = Table.grid(padding=(0, 2))
    for k, v in _machine_lines(result):
        head.add_row(f"[bold]{k}[/]", v)
    console.print(head)
    for title, headers, rows, note in tables(result):
        table = Table(title=title, title_justify="left", caption=note, caption_justify="left")
        for i, h in enumerate(headers):
            table.add_column(h, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvchat.bench --blas-probe --model M --tokens N``: one BLAS probe, JSON out."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvchat.bench")
    parser.add_argument("--blas-probe", action="store_true")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args(argv)
    if not args.blas_probe:
        parser.error("use `kvchat bench` for the benchmark; this entry point runs --blas-probe")
    print(json.dumps(blas_probe(args.model, args.tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
