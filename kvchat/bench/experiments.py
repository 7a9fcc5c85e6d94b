"""The bench's experiments, measured with and without the cache in one process."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, cast

from .common import (
    FOLLOW_UP,
    READ_PROMPT,
    SUMMARY_PROMPT,
    Log,
    bench_plan,
    bytes_per_token,
    eval_only_s,
    folder_bytes,
    make_text,
    median,
    median_profile,
    profile_cached_turn,
    ratio,
    run_turn,
    temp_home,
)

if TYPE_CHECKING:
    from kvchat.engine.conversation.session import Session
    from kvchat.engine.models.model import LoadedModel


class Bench:
    def __init__(self, lm: LoadedModel, quick: bool, log: Log | None = None):
        self.lm = lm
        self.quick = quick
        self.plan = bench_plan(quick)
        self.log = log or (lambda _msg: None)
        self.histories: dict[int, list[dict]] = {}
        self.sessions: dict[int, Session] = {}
        self.started = time.perf_counter()

    def _say(self, msg: str) -> None:
        self.log(f"[{time.perf_counter() - self.started:7.1f}s] {msg}")

    def _session(
        self, messages: list[dict] | None = None, max_tokens: int = 8, kind: str = "standard"
    ):
        from kvchat.engine.conversation.session import GenerationSettings, Session

        return Session(
            self.lm,
            kind=kind,
            messages=list(messages or []),
            settings=GenerationSettings(max_tokens=max_tokens, temp=0.0, ignore_eos=True),
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
        t1_fresh = t1_cached  # turn 1 starts from an empty cache either way: the same work
        self._say("classic: turn 2 with the cache")
        t2_cached = run_turn(a, SUMMARY_PROMPT)
        self._say("classic: turn 2 from an empty cache (same transcript, full prefill)")
        a.undo()
        a.reset()
        t2_fresh = run_turn(a, SUMMARY_PROMPT)
        turns = []
        for i, (c, u) in enumerate(((t1_cached, t1_fresh), (t2_cached, t2_fresh)), 1):
            turns.append(
                {
                    "turn": i,
                    "message": "read this article" if i == 1 else SUMMARY_PROMPT,
                    "prompt_tokens": c["prompt_tokens"],
                    "cached": _turn_view(c),
                    "uncached": _turn_view(u),
                    "speedup_prompt_eval": ratio(u["prompt_eval_s"], c["prompt_eval_s"]),
                    "speedup_ttft": ratio(u["ttft_s"], c["ttft_s"]),
                    "same_reply": c["tokens"] == u["tokens"],
                }
            )
        return {
            "article_tokens": len(tok.encode(article, add_special_tokens=False)),
            "turns": turns,
        }

    # 2 + 4 -------------------------------------------------- sweep, persistence
    def _grow(self, history: list[dict], target: int, seed: int) -> list[dict]:
        """Append synthetic exchanges until the transcript renders to about ``target`` tokens."""
        render = self._session().render
        history = list(history)
        have = len(render(history, False))
        while have < target - 16:
            need = target - have
            reply = make_text(self.lm.tokenizer, min(40, max(4, need // 8)), seed=seed + 1000)
            probe = [
                *history,
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": reply},
            ]
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

        from kvchat.engine.caches.kinds import copy_cache, make_cache, parse_kind, trim_to

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
            messages = [
                *history,
                {"role": "user", "content": FOLLOW_UP},
                {"role": "assistant", "content": reply},
            ]
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
                first_uncached = cast(int, mx.argmax(logits[0, -1]).item())
            clock += time.perf_counter() - t0
            done = len(prompt)
            uncached = {
                "ttft_s": render_s + clock,
                "prompt_eval_s": clock,
                "prompt_tokens": len(prompt),
            }

            h_tokens = render(history, False)
            copied = copy_cache(cache)
            if not trim_to(copied, len(h_tokens)):
                raise RuntimeError("could not cut the cache copy back to the history")
            from kvchat.engine.conversation.session import GenerationSettings, Session

            s = Session.restore(
                self.lm,
                messages=list(history),
                kind="standard",
                ledger=h_tokens,
                cache=copied,
                settings=GenerationSettings(
                    max_tokens=plan["follow_max_tokens"], temp=0.0, ignore_eos=True
                ),
            )
            if target in plan["persist_at"]:
                persists.append(self._persistence(s, target, uncached, first_uncached))
            self._say(f"sweep {target}: follow-up with the cache (x{plan['cached_repeats']})")
            cached_runs = []
            for _ in range(plan["cached_repeats"]):
                cached_runs.append(run_turn(s, FOLLOW_UP))
                s.undo()
            cached_med = median([r["ttft_s"] for r in cached_runs])
            new = prompt[cached_runs[0]["reused_tokens"] :]
            eval_only = median([eval_only_s(self.lm, new) for _ in range(plan["cached_repeats"])])
            self._say(f"sweep {target}: profile of the cached turn")
            profile = median_profile(
                [profile_cached_turn(s, FOLLOW_UP) for _ in range(plan["profile_repeats"])]
            )
            points.append(
                {
                    "target_tokens": target,
                    "history_tokens": len(h_tokens),
                    "new_tokens": cached_runs[0]["evaluated_tokens"],
                    "cached_ttft_s": cached_med,
                    "cached_ttft_best_s": min(r["ttft_s"] for r in cached_runs),
                    "cached_prompt_eval_s": median([r["prompt_eval_s"] for r in cached_runs]),
                    "uncached_ttft_s": uncached["ttft_s"],
                    "uncached_prompt_eval_s": uncached["prompt_eval_s"],
                    "uncached_prompt_tokens": len(prompt),
                    "speedup_ttft": ratio(uncached["ttft_s"], cached_med),
                    "eval_new_only_s": eval_only,
                    "cached_over_new_only": ratio(cached_med, eval_only),
                    "gen_tps_cached": median([r["gen_tps"] for r in cached_runs]),
                    # greedy: the cached turn's first token equals the fresh prefill's
                    "same_reply": all(r["tokens"][:1] == [first_uncached] for r in cached_runs),
                    "profile": profile,
                }
            )
            if target == plan["kinds_history"]:
                self.sessions[target] = s
            del s, copied
        del cache
        mx.clear_cache()
        return {
            "follow_up": FOLLOW_UP,
            "uncached_method": "one fresh prefill, timed per prompt",
            "points": points,
        }, {"points": persists}

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
            size = folder_bytes(folder)
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
            "speedup_ttft": ratio(uncached["ttft_s"], resumed["ttft_s"]),
            "load_plus_turn_speedup": ratio(uncached["ttft_s"], load_s + resumed["ttft_s"]),
            "same_reply": resumed["tokens"][:1] == [first_uncached],
        }

    # 3 ------------------------------------------------------------ kinds
    def kinds(self) -> dict[str, Any]:
        import mlx.core as mx

        from kvchat.engine.caches.families import FAMILIES
        from kvchat.engine.caches.kinds import QUANT_GROUP_SIZE, CacheKindError
        from kvchat.engine.conversation.session import GenerationSettings

        plan = self.plan
        target = plan["kinds_history"]
        base = self.sessions.get(target)
        history = self.histories.get(target)
        if base is None or history is None:
            history = self._grow([], target, seed=500)
            base = self._session(history)
            base.rebuild("bench")
        rows = []
        unavailable: dict[str, str] = {}  # kind -> why this backend or model cannot run it
        reference: list[int] | None = None
        for name in plan["kinds"]:
            self._say(f"kinds: {name} at {target} tokens, {plan['agree_tokens']} greedy tokens")
            child = base.fork_prefix(history)
            child.settings = GenerationSettings(
                max_tokens=plan["agree_tokens"], temp=0.0, ignore_eos=True
            )
            t0 = time.perf_counter()
            try:
                rebuilt = child.set_kind(name)
            except CacheKindError as error:
                self._say(f"kinds: {name} is not available on this backend: {error}")
                unavailable[name] = str(error)
                continue
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
            rows.append(
                {
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
                }
            )
            del child
            mx.clear_cache()
        std = next(r for r in rows if r["kind"] == "standard")
        for r in rows:
            r["bytes_vs_standard"] = ratio(r["bytes_per_token"], std["bytes_per_token"])
        # The same comparison for a 16-bit model: quantize the standard cache's keys
        # and values cast to float16 (scales and biases then take 16 bits too).
        keys16 = {}
        layer = base.cache[0]
        n_tokens = layer.offset
        k, v = layer.keys[..., :n_tokens, :], layer.values[..., :n_tokens, :]
        fp16 = (k.astype(mx.float16).nbytes + v.astype(mx.float16).nbytes) / n_tokens
        for bits in FAMILIES["quantized"].sizes:
            q = [
                mx.quantize(x.astype(mx.float16), group_size=QUANT_GROUP_SIZE, bits=bits)
                for x in (k, v)
            ]
            qbytes = sum(a.nbytes for pair in q for a in pair) / n_tokens
            keys16[f"quantized:{bits}"] = qbytes / fp16
        layers = len(base.cache)
        return {
            "history_tokens": len(base.ledger),
            "rows": rows,
            "unavailable": unavailable,
            "at_16_bit": {
                "standard_bytes_per_token": fp16 * layers,
                "ratios": keys16,
                "how": "standard cache keys/values cast to float16 and quantized (group 64); "
                "computed on layer 0, all layers have the same shape",
            },
        }


def _turn_view(r: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "prompt_tokens",
        "reused_tokens",
        "evaluated_tokens",
        "prompt_eval_s",
        "ttft_s",
        "generated_tokens",
        "gen_tps",
        "cache_tokens",
        "cache_bytes",
    )
    return {k: r[k] for k in keys}
