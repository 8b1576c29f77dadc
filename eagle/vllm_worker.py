"""The vLLM worker process: ``python -m eagle.vllm_worker JOB.json RESULT.json`` (see :mod:`eagle.vllm_engine`).

It builds the job's engines with vLLM's offline ``LLM`` API and either decodes the prompts greedily with every
engine (timed one prompt at a time, engines alternating so that drifts of the machine hit them alike, then all
prompts at once) or writes answers for them (regeneration). The result JSON holds token ids, wall times and
vLLM's own speculative-decoding counts: per request the histogram of accepted drafts per step, and the engine's
per-position counter ``vllm:spec_decode_num_accepted_tokens_per_pos``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from eagle.fileio import write_json_atomic
from eagle.vllm_engine import EngineSpec, Job, speculative_config


def build_engine(job: Job, engine: EngineSpec, share: int) -> Any:
    """An ``LLM`` for one engine of the job (``share``: engines on the same GPUs)."""
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=job.target,
        dtype=job.dtype,
        seed=job.seed,
        max_model_len=job.max_model_len,
        tensor_parallel_size=job.vllm.tensor_parallel_size,
        gpu_memory_utilization=job.vllm.gpu_memory_utilization / share,
        enforce_eager=job.vllm.enforce_eager,
        trust_remote_code=job.trust_remote_code,
        disable_log_stats=False,  # the spec-decode counters are kept only with stats on
    )
    if engine.draft is not None:
        spec = speculative_config(engine.draft, engine.num_speculative_tokens, engine.batch_schedule)
        if "method" not in spec:  # a speculators folder is served as such: it names its target (the verifier)
            kwargs["model"] = spec.pop("model")
        kwargs["speculative_config"] = spec
        kwargs["per_request_spec_decode_metrics"] = "summary"
    return LLM(**kwargs)


def _sampling(job: Job, max_tokens: int, seed: int | None = None) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=job.temperature,
        top_p=job.top_p,
        seed=seed,
        stop_token_ids=list(job.stop_token_ids),
        skip_special_tokens=True,
    )


def _per_position(llm: Any) -> list[int]:
    """The engine's cumulative ``vllm:spec_decode_num_accepted_tokens_per_pos`` (empty without drafts)."""
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            return [int(v) for v in metric.values]
    return []


def _counter(llm: Any, name: str) -> int:
    return sum(int(m.value) for m in llm.get_metrics() if m.name == name)


def _record(output: Any) -> dict[str, Any]:
    """Token ids, and for a speculative engine vLLM's histogram of accepted drafts per step, of one request."""
    done = output.outputs[0]
    metrics = done.spec_decode_metrics
    return {
        "tokens": [int(t) for t in done.token_ids],
        "finish_reason": done.finish_reason,
        "histogram": list(metrics.histogram) if metrics is not None else None,
        "num_draft_tokens": int(metrics.num_draft_tokens) if metrics is not None else None,
    }


def _counts(llm: Any) -> dict[str, Any]:
    return {
        "per_position": _per_position(llm),
        "drafts": _counter(llm, "vllm:spec_decode_num_drafts"),
        "draft_tokens": _counter(llm, "vllm:spec_decode_num_draft_tokens"),
        "accepted": _counter(llm, "vllm:spec_decode_num_accepted_tokens"),
    }


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    pos = [a - (before["per_position"][i] if i < len(before["per_position"]) else 0)
           for i, a in enumerate(after["per_position"])]
    return {"per_position": pos, **{k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}}


def _in_turn(names: list[str], i: int) -> list[str]:
    """The engines in the order they run the i-th prompt or group: each goes first as often as the others, so
    that drifts of the machine hit them alike."""
    return names[i % len(names):] + names[: i % len(names)]


def sweep_groups(n: int, b: int) -> list[list[int]]:
    """Prompt indices (b <= n) in G = ceil(n / b) groups of b distinct prompts: the indices in strided order
    (0, G, 2G, ..., then 1, G + 1, ...) so that each group mixes the prompt sets (they come one after another),
    cut into consecutive groups, the last one filled up from the start. Every prompt is in a group; when b does
    not divide n a few are in two, never twice in one (a request twice in a batch would share its prefill)."""
    count = -(-n // b)
    order = [i for g in range(count) for i in range(g, n, count)]
    return [[order[(g * b + j) % n] for j in range(b)] for g in range(count)]


def _sweep(job: Job, engines: dict[str, Any], prompts: list[Any], sampling: Any) -> dict[str, dict[str, Any]]:
    """Per engine and batch size b > 1 of ``job.vllm.batch_sizes``: the prompts in groups of b
    (:func:`sweep_groups`), each group submitted at once, the engines taking turns group by group."""
    names = [e.name for e in job.engines]
    out: dict[str, dict[str, Any]] = {name: {} for name in names}
    for b in sorted({b for b in job.vllm.batch_sizes if 1 < b <= len(prompts)}):
        runs = {name: {"seconds": 0.0, "requests": []} for name in names}
        for g, group in enumerate(sweep_groups(len(prompts), b)):
            for name in _in_turn(names, g):
                t0 = time.perf_counter()
                outs = engines[name].generate([prompts[i] for i in group], sampling, use_tqdm=False)
                runs[name]["seconds"] += time.perf_counter() - t0
                runs[name]["requests"] += [_record(o) for o in outs]
        for name in names:
            out[name][str(b)] = runs[name]
    return out


def decode(job: Job) -> dict[str, Any]:
    """Greedy decoding of every prompt by every engine: one at a time (alternating), then batched, then in
    groups of each batch size of the sweep."""
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in job.prompts]
    result: dict[str, Any] = {"engines": {}}
    engines = {}
    # vLLM keeps its counters in one process-wide registry that each new engine resets: built last, a job's only
    # speculative engine keeps valid counters (with several, the per-request histograms are the only counts)
    ordered = sorted(job.engines, key=lambda e: e.draft is not None)
    heads = [e.name for e in ordered if e.draft is not None]
    counted = heads if len(heads) == 1 else []
    for spec in ordered:
        t0 = time.perf_counter()
        engines[spec.name] = build_engine(job, spec, len(job.engines))
        result["engines"][spec.name] = {"load_seconds": time.perf_counter() - t0, "single": [], "batched": None}
    sampling = _sampling(job, job.max_new_tokens)
    for llm in engines.values():  # warm-up: first-call compilation and allocations stay out of the timings
        for _ in range(job.warmup):
            llm.generate(prompts[:1], _sampling(job, min(job.max_new_tokens, 16)), use_tqdm=False)
    before = {name: _counts(engines[name]) for name in counted}
    names = [e.name for e in job.engines]
    for k, prompt in enumerate(prompts):
        for name in _in_turn(names, k):
            t0 = time.perf_counter()
            out = engines[name].generate([prompt], sampling, use_tqdm=False)[0]
            seconds = time.perf_counter() - t0
            result["engines"][name]["single"].append({**_record(out), "seconds": seconds})
    middle = {name: _counts(engines[name]) for name in counted}
    for name in counted:
        result["engines"][name]["single_counts"] = _delta(middle[name], before[name])
    if job.vllm.batched:
        for name in names:
            llm = engines[name]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sampling, use_tqdm=False)
            seconds = time.perf_counter() - t0
            result["engines"][name]["batched"] = {
                "seconds": seconds,
                "requests": [_record(o) for o in outs],
                "counts": _delta(_counts(llm), middle[name]) if name in counted else None,
            }
    if job.vllm.batch_sizes:
        for name, by_size in _sweep(job, engines, prompts, sampling).items():
            result["engines"][name]["sweep"] = by_size
    return result


def generate(job: Job) -> dict[str, Any]:
    """Answers for the prompts, appended to ``job.answers_path`` one chunk at a time as ``{**key, "content",
    "tokens"}`` lines (the parent passes only prompts without an answer, so a killed job resumes)."""
    from vllm.inputs import TokensPrompt

    t_start = time.perf_counter()
    llm = build_engine(job, job.engines[0], 1)
    load = time.perf_counter() - t_start
    written = tokens = chunks = 0
    spent = 0.0
    stopped = False
    with Path(job.answers_path).open("a", encoding="utf-8") as sink:
        for start in range(0, len(job.prompts), job.chunk):
            if chunks and job.time_limit_s is not None:
                # no new chunk unless one of the mean duration so far ends within the limit
                if time.perf_counter() - t_start + spent / chunks > job.time_limit_s:
                    stopped = True
                    break
            idx = range(start, min(start + job.chunk, len(job.prompts)))
            t0 = time.perf_counter()
            # a seed per prompt (from its key): a resumed run samples the same answer for the same prompt
            params = [_sampling(job, job.max_new_tokens, seed=_seed(job.seed, job.keys[i])) for i in idx]
            outs = llm.generate([TokensPrompt(prompt_token_ids=list(job.prompts[i])) for i in idx], params,
                                use_tqdm=False)
            for i, out in zip(idx, outs):
                done = out.outputs[0]
                tokens += len(done.token_ids)
                sink.write(json.dumps({**job.keys[i], "content": done.text, "tokens": len(done.token_ids)}) + "\n")
            sink.flush()
            written += len(idx)
            chunks += 1
            spent += time.perf_counter() - t0
            print(f"vllm: {written}/{len(job.prompts)} answered", flush=True)
    return {"load_seconds": load, "answered": written, "tokens": tokens, "generate_seconds": spent,
            "left": len(job.prompts) - written, "stopped_by_time_limit": stopped}


def _seed(seed: int, key: Any) -> int:
    digest = hashlib.sha256(json.dumps([seed, key], sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def main(argv: list[str] | None = None) -> int:
    """Run the job in ``argv[0]``, write the result to ``argv[1]``; exit status 0 also when the job's own
    check failed (the result then holds ``error``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    job = Job.from_json(Path(args[0]).read_text(encoding="utf-8"))
    import vllm

    try:
        result = decode(job) if job.kind == "decode" else generate(job)
    except Exception as e:  # noqa: BLE001 -- reported to the parent with its traceback
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"}
    result["vllm_version"] = vllm.__version__
    write_json_atomic(result, args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
