"""``eagle eval --engine vllm|both``: the exported head served by vLLM, and its parity with our own loop.

``vllm``: the same prompt sets as the HF loop, decoded greedily by vLLM with the exported head (a chain of
``eval.vllm.num_speculative_tokens`` drafts per step: vLLM has no tree attention) and without it, in one worker
(:mod:`eagle.vllm_engine`), one prompt at a time with the two engines alternating, then every prompt at once. The
report has the HF loop's schema (per set and overall: tau, per-depth acceptance, tokens/s, speedup, greedy
match) computed from vLLM's own counts (each request's histogram of accepted drafts per step), plus ``batched``
(throughput with and without the head), ``engine: "vllm"``, and with ``vllm.batch_sizes`` a ``batch_sweep``
(the same by concurrent requests, and the batch sizes where the head pays: :mod:`eagle.batch_schedule`). Greedy
differences between the speculative and the plain output are refereed by :mod:`eagle.exactness` with the HF
target in the same dtype (a near-tie of the target's logits, or a bug).

``both``: also the HF loop (its tree, and a chain of the same length as vLLM's) on the same prompts in the same
dtype, and a **parity** check (:func:`parity`): at every draft position vLLM's acceptance rate must not fall below
the HF chain's by more than ``PARITY_Z`` binomial standard errors, and vLLM must not reach a lower tau on
significantly more prompts than a higher one (a paired sign test). A layout mistake in the export (aux-layer
numbering, norm order, d2t offsets, rope settings, fc input order) leaves the head drafting from the wrong inputs
inside the engine, which shows up exactly so: acceptance below what the same head reaches in our loop.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from eagle.batch_schedule import describe as describe_sweep
from eagle.batch_schedule import fit_schedule, sweep_row
from eagle.errors import CheckFailed, EagleError
from eagle.evaluate import EvalConfig
from eagle.exactness import diagnose_mismatch, mismatch_note, mismatch_summary
from eagle.fileio import write_json_atomic
from eagle.metrics import PromptRun, print_report_table, prompt_record, summarize, versions
from eagle.prompts import load_prompt_sets
from eagle.speculate import GenerationResult
from eagle.speed_model import fit_speed_model, speed_points
from eagle.vllm_engine import EngineSpec, Job, accepted_per_position, run_job, speculative_method

PARITY_Z = 4.0  # standard errors vLLM's acceptance may trail the HF loop's at a position before parity fails
PARITY_PAIRED_P = 0.01  # the sign test's one-sided level (a correct export: vLLM lower as often as higher)
# in float32 both engines draft the same tokens from the same text up to rounding: a correct export gives the same
# tau on (nearly) every prompt, one that feeds the head other features (an aux layer off by one) on few
PARITY_FP32_AGREEMENT = 0.9
# what a parity failure points at, in the order a layout mistake is most likely
SUSPECT_FIELDS = (
    "eagle_aux_hidden_state_layer_ids (aux-layer numbering: vLLM reads HF hidden_states[k], SGLang k - 1)",
    "fc.weight column order (the aux layers' order low -> mid -> high)",
    "norm_before_residual and the hidden_norm / input_layernorm order",
    "d2t offsets (draft id + d2t[id] = target id)",
    "rope_theta / rope_scaling / rope_parameters and max_position_embeddings",
)


class ParityError(CheckFailed):
    """vLLM's acceptance with an exported head is far below the HF loop's with the same head."""


def _eos_ids(target_dir: str, tokenizer: Any, trust_remote_code: bool = False) -> list[int]:
    """End-of-generation ids from the target folder's generation / model config and the tokenizer."""
    from transformers import AutoConfig, GenerationConfig

    ids: set[int] = set()
    sources: list[Any] = [tokenizer]
    try:
        sources.append(GenerationConfig.from_pretrained(target_dir))
    except (OSError, ValueError):
        pass
    sources.append(AutoConfig.from_pretrained(target_dir, trust_remote_code=trust_remote_code))
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value if v is not None)
    return sorted(ids)


def _max_model_len(target_dir: str, longest_prompt: int, max_new_tokens: int, k: int,
                   trust_remote_code: bool = False) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_dir, trust_remote_code=trust_remote_code).get_text_config()
    need = longest_prompt + max_new_tokens + k + 8
    limit = getattr(config, "max_position_embeddings", None)
    if limit and need > limit:
        raise EagleError(
            f"the longest prompt ({longest_prompt} tokens) plus eval.max_new_tokens={max_new_tokens} needs {need} "
            f"positions, more than the target's max_position_embeddings={limit}: lower eval.max_new_tokens"
        )
    return need


def _spec_result(record: dict[str, Any], seconds: float) -> GenerationResult:
    """A vLLM request as our GenerationResult: steps and per-depth counts from vLLM's histogram."""
    hist = record["histogram"] or [0]
    return GenerationResult(
        tokens=list(record["tokens"]),
        accept_lengths=[j + 1 for j, n in enumerate(hist) for _ in range(n)],
        target_forwards=sum(hist),
        accepted_per_depth=accepted_per_position(hist),
        total_time=seconds,
    )


def _plain_result(record: dict[str, Any], seconds: float) -> GenerationResult:
    n = len(record["tokens"])
    return GenerationResult(tokens=list(record["tokens"]), accept_lengths=[1] * max(n - 1, 0),
                            target_forwards=max(n - 1, 0), total_time=seconds)


def _batched_summary(engines: dict[str, Any], name: str) -> dict[str, Any] | None:
    if "plain" not in engines:
        return None
    plain, spec = engines["plain"].get("batched"), engines[name].get("batched")
    if not plain or not spec:
        return None
    runs = [
        PromptRun("batched", str(i), 0, _spec_result(s, 0.0), _plain_result(p, 0.0))
        for i, (s, p) in enumerate(zip(spec["requests"], plain["requests"]))
    ]
    summary = summarize(runs, 0.0)
    pooled = _pooled(len(runs), spec, plain)
    return {
        "num_prompts": len(runs),
        **{key: pooled[key] for key in ("tokens_per_second", "baseline_tokens_per_second", "speedup")},
        "acceptance_length_mean": summary["acceptance_length_mean"],
        "per_depth_acceptance": summary["per_depth_acceptance"],
        "greedy_match_rate": pooled["greedy_match_rate"],
        "engine_counts": spec["counts"],
        "time_s": spec["seconds"],
        "baseline_time_s": plain["seconds"],
    }


def _batch_sweep(engines: dict[str, Any], name: str, k: int,
                 served_with: list[list[int]] | None = None) -> dict[str, Any] | None:
    """Tokens/s with the head and without by concurrent requests (batch 1: the one-at-a-time runs), and the
    batch-size schedule they call for (:mod:`eagle.batch_schedule`), or the one the head was ``served_with``;
    None without a sweep or a baseline."""
    if "plain" not in engines or not engines[name].get("sweep"):
        return None
    spec, plain = engines[name], engines["plain"]
    by_size = {1: ({"requests": spec["single"], "seconds": sum(r["seconds"] for r in spec["single"])},
                   {"requests": plain["single"], "seconds": sum(r["seconds"] for r in plain["single"])})}
    by_size.update({int(b): (run, plain["sweep"][b]) for b, run in spec["sweep"].items()})
    return fit_schedule([_pooled(b, s, p) for b, (s, p) in sorted(by_size.items())], k, served_with)


def _pooled(batch_size: int, spec: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    """Pooled tokens/s with the head and without, and outputs equal, of two runs of the same requests
    (``{"requests": [records], "seconds": s}``)."""
    matches = [x["tokens"] == y["tokens"] for x, y in zip(spec["requests"], plain["requests"])]
    drafted = [x.get("num_draft_tokens") for x in spec["requests"]]
    return sweep_row(batch_size, sum(len(x["tokens"]) for x in spec["requests"]), spec["seconds"],
                     sum(len(y["tokens"]) for y in plain["requests"]), plain["seconds"], matches,
                     None if None in drafted else sum(drafted))


def _check_batch_settings(vllm: Any, ks: Sequence[int], prompts: int, baseline: bool = True) -> None:
    """A sweep needs a batch size it can fill and plain vLLM to compare with; a schedule belongs to one chain
    length."""
    if vllm.batch_sizes and not baseline:
        raise EagleError("eval.vllm.batch_sizes compares the head with plain vLLM at each batch size: set "
                         "eval.baseline=true, or eval.vllm.batch_sizes=[] to skip the sweep")
    if vllm.batch_sizes and not any(1 < b <= prompts for b in vllm.batch_sizes):
        raise EagleError(f"eval.vllm.batch_sizes={vllm.batch_sizes} holds no size from 2 to the {prompts} prompts "
                         "evaluated (batch 1 is the one-at-a-time run): give sizes in that range or more prompts")
    if vllm.batch_schedule and list(ks) != [vllm.num_speculative_tokens]:
        raise EagleError(f"eval.vllm.batch_schedule serves one chain length (num_speculative_tokens="
                         f"{vllm.num_speculative_tokens}), not k = {list(ks)}: measure one k at a time")


def _referee(runs: list[PromptRun], hf_model: Callable[[], Any], dtype: str) -> dict[str, Any]:
    """Near-tie or bug for every prompt whose speculative output differs from plain (``hf_model()``: the HF
    target in the same dtype, asked for only when an output differs)."""
    differing = [r for r in runs if r.spec.tokens != r.plain.tokens]
    model = hf_model() if differing else None
    for r in runs:
        r.mismatch = (diagnose_mismatch(model, r.prompt_ids, r.plain.tokens, r.spec.tokens)
                      if r in differing else None)
    return mismatch_summary([r.mismatch for r in runs], getattr(torch, dtype))


def _prompt_runs(sets: list, flat: list, spec: list[dict[str, Any]],
                 plains: list[dict[str, Any] | None]) -> dict[str, list[PromptRun]]:
    """Each prompt set's runs from one head engine's records and the plain engine's (None without a baseline)."""
    runs: dict[str, list[PromptRun]] = {name: [] for name, _ in sets}
    for (name, pid, ids), s, p in zip(flat, spec, plains):
        plain = _plain_result(p, p["seconds"]) if p is not None else None
        runs[name].append(PromptRun(name, pid, len(ids), _spec_result(s, s["seconds"]), plain, prompt_ids=ids))
    return runs


def _decode_job(cfg: EvalConfig, draft: str, target_dir: str, dtype: str, ks: Sequence[int],
                trust_remote_code: bool) -> tuple[list, list, Job]:
    """The prompt sets, the prompts in one list of (set, id, token ids), and the worker's job that decodes them
    with a head engine per k and (``cfg.baseline``) a plain one. Multi-turn questions (MT-bench) run their first
    turn here: a later turn needs the answer to the one before, which a one-job decode does not have."""
    from eagle.targets import load_tokenizer

    tokenizer = load_tokenizer(target_dir, trust_remote_code=trust_remote_code)
    sets = load_prompt_sets(cfg.prompts, tokenizer, cfg.max_prompts)
    eos = _eos_ids(target_dir, tokenizer, trust_remote_code)
    flat = [(name, pid, ids) for name, prompts in sets for pid, ids in prompts]
    _check_batch_settings(cfg.vllm, ks, len(flat), cfg.baseline)
    job = Job(
        kind="decode", target=target_dir, dtype=dtype,
        engines=[EngineSpec(f"k{k}", draft, k, cfg.vllm.batch_schedule) for k in ks]
        + ([EngineSpec("plain")] if cfg.baseline else []),
        prompts=[ids for _, _, ids in flat], max_new_tokens=cfg.max_new_tokens, stop_token_ids=eos,
        max_model_len=_max_model_len(target_dir, max(len(ids) for *_, ids in flat), cfg.max_new_tokens, max(ks),
                                     trust_remote_code),
        vllm=cfg.vllm, seed=cfg.seed, warmup=cfg.warmup, trust_remote_code=trust_remote_code,
    )
    return sets, flat, job


def vllm_reports(
    cfg: EvalConfig, target_name: str, dtype: str, ks: Sequence[int], trust_remote_code: bool = False,
    console: Any = None, referee: Any = None,
) -> dict[int, dict[str, Any]]:
    """One report per chain length in ``ks``: ``cfg.prompts`` decoded by vLLM with the head in ``cfg.draft``
    drafting k tokens a step, and (``cfg.baseline``) without it, all engines in one worker, taking turns.
    ``referee``: the HF target already loaded in ``dtype`` to judge greedy differences (else loaded on the CPU
    when one occurs)."""
    from rich.console import Console

    from eagle.targets import load_target, parse_dtype, resolve_target

    cfg.validate()
    console = console or Console()
    dtype = str(parse_dtype(dtype)).removeprefix("torch.")  # vLLM takes these names, not bf16 / fp32
    if cfg.temperature > 0:
        raise EagleError("eval --engine vllm measures greedy decoding: set eval.temperature=0")
    draft = str(Path(cfg.draft))
    method = speculative_method(draft) or "speculators"
    target_dir = resolve_target(target_name)
    sets, flat, job = _decode_job(cfg, draft, target_dir, dtype, ks, trust_remote_code)
    eos = job.stop_token_ids
    with console.status(f"vLLM: {len(flat)} prompts, with the head ({method}, k={list(ks)}) and without, in {dtype}"):
        result = run_job(job, "eagle eval --engine vllm")
    engines = result["engines"]
    plains = engines["plain"]["single"] if "plain" in engines else [None] * len(flat)
    common = {
        "engine": "vllm", "target": target_name, "target_path": target_dir, "head": draft, "method": method,
        "device": "cuda" if torch.cuda.is_available() else "cpu", "dtype": dtype,
        "vllm_version": result.get("vllm_version"), **versions(),
    }
    hf_model = functools.cache(lambda: referee if referee is not None else load_target(
        target_dir, dtype=dtype, device="cpu", trust_remote_code=trust_remote_code).model)  # once for every k
    reports = {}
    for k in ks:
        runs = _prompt_runs(sets, flat, engines[f"k{k}"]["single"], plains)
        all_runs = [r for name, _ in sets for r in runs[name]]
        reports[k] = {
            **common,
            "settings": {"prompts": list(cfg.prompts), "max_prompts": cfg.max_prompts,
                         "max_new_tokens": cfg.max_new_tokens, "temperature": 0.0, "seed": cfg.seed,
                         "warmup": cfg.warmup, "num_speculative_tokens": k, "eos_token_ids": eos,
                         "vllm": {**vars(cfg.vllm), "num_speculative_tokens": k}},
            "tree": {"policy": "chain", "depth": k, "tree_tokens": k + 1},
            "load_seconds": {name: engines[name]["load_seconds"] for name in (f"k{k}", "plain") if name in engines},
            "prompt_sets": {name: summarize(runs[name], 0.0) for name, _ in sets},
            "overall": summarize(all_runs, 0.0),
            "engine_counts": engines[f"k{k}"].get("single_counts"),  # vLLM's own counters (one head engine)
            "speed_model": fit_speed_model(speed_points(all_runs), k + 1),  # a chain of k: k + 1 tokens a step
            "batched": _batched_summary(engines, f"k{k}"),
            "batch_sweep": _batch_sweep(engines, f"k{k}", k, cfg.vllm.batch_schedule),
            "greedy_mismatches": _referee(all_runs, hf_model, dtype) if cfg.baseline else None,
            "prompts": [prompt_record(r) for r in all_runs],
        }
    return reports


def evaluate_vllm(
    cfg: EvalConfig, target_name: str, dtype: str, trust_remote_code: bool = False, console: Any = None,
    write: bool = True, referee: Any = None,
) -> dict[str, Any]:
    """Decode ``cfg.prompts`` through vLLM with and without the head in ``cfg.draft`` (a chain of
    ``cfg.vllm.num_speculative_tokens``); returns the report, and with ``write`` writes and prints it.
    ``referee``: as in :func:`vllm_reports`."""
    from rich.console import Console

    console = console or Console()
    k = cfg.vllm.num_speculative_tokens
    report = vllm_reports(cfg, target_name, dtype, [k], trust_remote_code, console, referee)[k]
    if write:
        write_json_atomic(report, cfg.report)
        print_vllm_report(report, console)
        console.print(f"report: {cfg.report}")
    return report


def batched_line(report: dict[str, Any]) -> str | None:
    """The report's all-prompts-at-once run in one line (None without one)."""
    batched = report.get("batched")
    if not batched:
        return None
    tau = batched["acceptance_length_mean"]
    # vLLM counts acceptance over the steps that drafted; under a served schedule those may be few or none
    scheduled = (report.get("settings") or {}).get("vllm", {}).get("batch_schedule")
    tau_text = ("no step drafted" if tau is None else f"tau {tau:.2f}") + (
        " over the steps that drafted (a batch schedule is served)" if scheduled and tau is not None else "")
    return (f"vLLM batched ({batched['num_prompts']} prompts at once): {batched['tokens_per_second']:.1f} tok/s "
            f"with the head vs {batched['baseline_tokens_per_second']:.1f} without ({batched['speedup']:.2f}x), "
            f"{tau_text}")


def print_vllm_report(report: dict[str, Any], console: Any) -> None:
    """The HF loop's table plus the batched line and the referee's note."""
    print_report_table(report, console)
    line = batched_line(report)
    if line:
        console.print(line, highlight=False)
    if report.get("batch_sweep"):
        console.print(f"vLLM {describe_sweep(report['batch_sweep'])}", highlight=False)
    note = mismatch_note(report["greedy_mismatches"]) if report.get("greedy_mismatches") else None
    if note:
        console.print(note)


# ------------------------------------------------------------------------------------------------ parity


def _counts_hf(section: dict[str, Any]) -> tuple[list[int], int]:
    return list(section.get("chain_accepted_per_depth") or []), int(section.get("chain_target_forwards") or 0)


def _counts_vllm(section: dict[str, Any]) -> tuple[list[int], int]:
    steps = int(section["target_forwards"])
    return [round(p * steps) for p in section["per_depth_acceptance"]], steps


def _paired(hf_report: dict[str, Any], vllm_report: dict[str, Any]) -> dict[str, Any]:
    """Per prompt decoded by both engines: does vLLM reach a lower tau than our chain (``worse``), a higher one
    (``better``) or the same? One-sided sign test of "worse as often as better" (``p``)."""
    hf = {(r["set"], r["id"]): r.get("chain_acceptance_length_mean") for r in hf_report.get("prompts", [])}
    worse = better = ties = 0
    for r in vllm_report.get("prompts", []):
        mine, theirs = r.get("acceptance_length_mean"), hf.get((r["set"], r["id"]))
        if mine is None or theirs is None:
            continue
        if abs(mine - theirs) <= 1e-9:
            ties += 1
        elif mine < theirs:
            worse += 1
        else:
            better += 1
    n = worse + better
    p = sum(math.comb(n, j) for j in range(worse, n + 1)) / 2**n if n else 1.0
    return {"worse": worse, "better": better, "ties": ties, "p": p}


def parity(hf_report: dict[str, Any], vllm_report: dict[str, Any], z: float = PARITY_Z,
           paired_p: float = PARITY_PAIRED_P) -> dict[str, Any]:
    """vLLM's acceptance against the HF chain's, with the same head on the same prompts; ``ok`` False on either:

    * per draft position, vLLM's rate trails by more than ``z`` binomial standard errors (pooled);
    * per prompt, vLLM reaches a lower tau on significantly more prompts than a higher one (one-sided sign test,
      p < ``paired_p``): pairing removes the prompt-to-prompt spread that dominates the binomial error;
    * in float32 (both reports), the two give the same tau on fewer than :data:`PARITY_FP32_AGREEMENT` of the
      prompts: there both engines decode the same text and draft the same tokens up to rounding, so a correct
      export ties almost everywhere, while a subtly wrong one (an aux layer off by one, which a weak head barely
      notices on average) changes the drafts on many prompts.
    """
    hf_acc, hf_steps = _counts_hf(hf_report["overall"])
    v_acc, v_steps = _counts_vllm(vllm_report["overall"])
    if not hf_steps or not v_steps:
        raise EagleError("parity needs speculative steps from both engines: give more prompts or longer answers")
    rows = []
    for i in range(min(len(hf_acc), len(v_acc))):
        p_h, p_v = hf_acc[i] / hf_steps, v_acc[i] / v_steps
        pooled = (hf_acc[i] + v_acc[i]) / (hf_steps + v_steps)
        # pooled under "both engines accept alike"; at least one acceptance's worth so that 0 vs 0 passes
        se = math.sqrt(max(pooled * (1 - pooled), 1.0 / (hf_steps + v_steps)) * (1 / hf_steps + 1 / v_steps))
        rows.append({"position": i + 1, "hf": p_h, "vllm": p_v, "hf_accepted": hf_acc[i], "vllm_accepted": v_acc[i],
                     "se": se, "z": (p_h - p_v) / se, "ok": p_h - p_v <= z * se})
    paired = _paired(hf_report, vllm_report)
    paired["ok"] = paired["p"] >= paired_p
    compared = paired["worse"] + paired["better"] + paired["ties"]
    fp32 = hf_report.get("dtype") == vllm_report.get("dtype") == "float32"
    agreement = paired["ties"] / compared if compared else None
    paired["agreement"] = agreement
    paired["agreement_required"] = PARITY_FP32_AGREEMENT if fp32 else None
    if fp32 and agreement is not None and agreement < PARITY_FP32_AGREEMENT:
        paired["ok"] = False
    return {"z_limit": z, "paired_p_limit": paired_p, "hf_steps": hf_steps, "vllm_steps": v_steps,
            "hf_tau": hf_report["overall"].get("chain_acceptance_length_mean"),
            "vllm_tau": vllm_report["overall"]["acceptance_length_mean"],
            "positions": rows, "paired": paired, "ok": all(r["ok"] for r in rows) and paired["ok"]}


def parity_message(result: dict[str, Any], draft: str) -> str:
    """Why a parity failure matters and which export fields to check."""
    found = [f"position {r['position']}: vLLM {r['vllm']:.3f} vs HF {r['hf']:.3f} ({r['z']:.1f} SE)"
             for r in result["positions"] if not r["ok"]]
    paired = result["paired"]
    if not paired["ok"]:
        found.append(f"lower tau on {paired['worse']} prompts, higher on {paired['better']}, the same on "
                     f"{paired['ties']} (sign test p = {paired['p']:.2g}"
                     + (f"; float32 needs the same on {paired['agreement_required']:.0%})"
                        if paired["agreement_required"] else ")"))
    return (
        f"parity failed for {draft}: vLLM accepts fewer drafts than our loop with the same head and chain "
        f"({'; '.join(found)}). vLLM reads this export differently from how it was trained; check these fields "
        f"of its config.json / model.safetensors: " + "; ".join(SUSPECT_FIELDS)
    )


def print_parity(result: dict[str, Any], console: Any) -> None:
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, title="parity: acceptance per draft position, vLLM vs the HF loop (chain)")
    for col in ("position", "HF loop", "vLLM", "SE", "HF - vLLM (SE)", "ok"):
        table.add_column(col, justify="right")
    for r in result["positions"]:
        table.add_row(str(r["position"]), f"{r['hf']:.3f}", f"{r['vllm']:.3f}", f"{r['se']:.3f}",
                      f"{r['z']:+.1f}", "yes" if r["ok"] else "[red]NO[/]")
    console.print(table)
    paired = result["paired"]
    console.print(f"tau with a chain of {len(result['positions'])}: HF loop {result['hf_tau'] or 0:.2f}, "
                  f"vLLM {result['vllm_tau'] or 0:.2f} ({result['hf_steps']} / {result['vllm_steps']} steps); "
                  f"per prompt vLLM lower on {paired['worse']}, higher on {paired['better']}, equal on "
                  f"{paired['ties']} (sign test p = {paired['p']:.2g}{'' if paired['ok'] else ', [red]failed[/]'})",
                  highlight=False)


def evaluate_both(cfg: EvalConfig, target: Any, target_name: str, console: Any = None,
                  trust_remote_code: bool = False) -> dict[str, Any]:
    """The HF loop (tree + a chain as long as vLLM's, the head in the target's dtype) and vLLM on the same
    prompts, their parity, one report; raises :class:`ParityError` (after writing it) when parity fails."""
    from rich.console import Console

    from eagle.evaluate import evaluate

    console = console or Console()
    dtype = str(target.dtype).removeprefix("torch.")
    hf_cfg = replace(cfg, chain_depth=cfg.vllm.num_speculative_tokens, draft_dtype=None)
    report = evaluate(hf_cfg, target, console=console)
    vllm_report = evaluate_vllm(cfg, target_name, dtype, trust_remote_code, console=console, write=False,
                                referee=target.model if target.model.device.type == "cpu" else None)
    print_vllm_report(vllm_report, console)
    result = parity(report, vllm_report)
    print_parity(result, console)
    report.update(engine="both", vllm=vllm_report, parity=result)
    write_json_atomic(report, cfg.report)
    console.print(f"report: {cfg.report}")
    if not result["ok"]:
        raise ParityError(parity_message(result, str(cfg.draft)))
    return report
