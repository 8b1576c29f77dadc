"""``eagle eval``: speculative decoding with a draft head vs plain decoding vs prompt lookup, on prompt sets.

For every prompt the three methods run back to back (their order rotating from prompt to prompt, so that slow
drifts of the machine hit them alike), each timed with the wall clock:

1. speculative decoding with the head (:func:`eagle.speculate.speculative_generate`);
2. plain decoding of the same target, one forward per token (:func:`eagle.speculate.plain_generate`);
3. transformers' prompt-lookup decoding (``generate(prompt_lookup_num_tokens=N, do_sample=False)``), cut to
   ``max_new_tokens`` (assisted generation can run a few tokens past it) and after the first EOS.

The report (``report.json``, written atomically, plots beside it) holds per prompt set and overall the fields
DESIGN.md lists. tau (``acceptance_length_*``) counts tokens per verification forward (accepted drafts + 1); the
prefill forward that produces the first token is counted apart (``prefill_forwards``). ``acceptance_length_mean``
pools all verification steps; ``acceptance_length_median`` is the median of the per-prompt means. At temperature
0 every prompt whose speculative output differs from plain decoding is refereed by :mod:`eagle.exactness` (a
near-tie of the target's logits, i.e. numerics, or a bug): ``greedy_mismatches`` and a note after the table.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from eagle.autotune import DEFAULT_CANDIDATES, autotune_total_tokens, max_tree_nodes
from eagle.deadline import Deadline, check_minutes
from eagle.drafter import Drafter, HeadDrafter, resolve_draft_dtype
from eagle.errors import EagleError
from eagle.exactness import diagnose_mismatch, first_mismatch, mismatch_note, mismatch_summary
from eagle.fileio import write_json_atomic
from eagle.speculate import GenerationResult, plain_generate, speculative_generate
from eagle.tree import TreeConfig, lookup_length
from eagle.vllm_engine import VllmConfig

METHODS = ("speculative", "chain", "plain", "prompt_lookup")
ENGINES = ("hf", "vllm", "both")
MIN_PROMPTS_PER_SET = 3  # what a time-limited evaluation still runs from every set


@dataclass
class EvalConfig:
    """The ``eval:`` section of a run config."""

    # hf: our loop (tree drafts); vllm: the exported head served by vLLM (eagle.vllm_eval); both: the two on the
    # same prompts plus their parity check
    engine: str = "hf"
    draft: str = "{run_dir}/export"  # exported draft directory (model.safetensors + config.json)
    prompts: list[str] = field(default_factory=lambda: ["dev-chat", "dev-code"])  # named sets or JSONL files
    max_prompts: int | None = None  # per prompts file
    # wall-time limit: prompts run in turn from each set and no new one starts unless one of the mean duration so
    # far would end in time (each set still gets MIN_PROMPTS_PER_SET); null = every prompt. The demo sets it.
    max_minutes: float | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    tree: TreeConfig = field(default_factory=TreeConfig)
    autotune_candidates: list[int] = field(default_factory=lambda: list(DEFAULT_CANDIDATES))
    baseline: bool = True  # plain decoding of the target (speedup, greedy match)
    prompt_lookup: bool = True  # transformers' prompt-lookup decoding, for comparison
    prompt_lookup_num_tokens: int = 10
    # also decode with a chain of this many drafts (no tree, no lookup branch): what an engine without tree
    # attention (vLLM, num_speculative_tokens) gets from the same head, shown beside the tree's figures; 0 = off
    chain_depth: int = 3
    report: str = "{run_dir}/eval/report.json"
    warmup: int = 1  # untimed warm-up generations per method before the timed ones
    # on a CPU: swap the target's and the head's fp32 linear layers for oneDNN ones with prepacked weights
    # (eagle.targets.prepack_for_cpu) -- tree verification gets cheaper; plain decoding uses the same model
    cpu_prepack: bool = False
    # the dtype the draft head (loaded from ``draft``) computes in: auto = bfloat16 on a CPU with native bf16
    # instructions (drafting ~1.6x faster, same acceptance: TUNING.md run 32), else the target's; null = the
    # target's; or float32 / bfloat16 / float16. The target verifies every token, so the output never changes
    draft_dtype: str | None = "auto"
    vllm: VllmConfig = field(default_factory=VllmConfig)

    def validate(self) -> EvalConfig:
        """Raise EagleError naming the bad key and the fix; return self."""
        if self.engine not in ENGINES:
            raise EagleError(f"eval.engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        self.vllm.validate("eval.vllm")
        if not self.prompts:
            raise EagleError(
                "eval.prompts is empty: give prompts files or named sets, e.g. [dev-chat, dev-code]"
            )
        if self.max_prompts is not None and self.max_prompts < 1:
            raise EagleError(f"eval.max_prompts must be >= 1 or null (all), got {self.max_prompts}")
        check_minutes(self.max_minutes, "eval.max_minutes")
        if self.max_new_tokens < 1:
            raise EagleError(f"eval.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise EagleError(f"eval.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise EagleError(f"eval.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EagleError(f"eval.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.prompt_lookup_num_tokens < 1:
            raise EagleError(
                f"eval.prompt_lookup_num_tokens must be >= 1, got {self.prompt_lookup_num_tokens}"
            )
        if not isinstance(self.chain_depth, int) or not 0 <= self.chain_depth <= 16:
            raise EagleError(f"eval.chain_depth must be 0 (off) to 16, got {self.chain_depth!r}")
        if self.warmup < 0:
            raise EagleError(f"eval.warmup must be >= 0, got {self.warmup}")
        if not self.autotune_candidates or any(c < 2 for c in self.autotune_candidates):
            raise EagleError(
                f"eval.autotune_candidates must be tree sizes >= 2, got {self.autotune_candidates}; e.g. [4, 8, 16]"
            )
        if not str(self.report).endswith(".json"):
            raise EagleError(f"eval.report must be a .json path, got {self.report!r}")
        resolve_draft_dtype(self.draft_dtype, "cpu", torch.float32)  # names the allowed values when bad
        self.tree.validate()
        return self


# ----------------------------------------------------------------------------------------- prompts


def _set_names(specs: Sequence[str]) -> list[str]:
    """A short unique name per prompts spec: named sets keep their name, files their stem."""
    from train.sources import NAMED_PROMPT_SETS

    names: list[str] = []
    for spec in specs:
        base = spec if spec in NAMED_PROMPT_SETS else Path(spec).stem
        name, n = base, 2
        while name in names or name == "overall":
            name, n = f"{base}-{n}", n + 1
        names.append(name)
    return names


def prompt_token_ids(prompt: dict[str, Any], tokenizer: Any) -> list[int]:
    """Token ids of one evaluation prompt: ``messages`` through the chat template (generation prompt added),
    ``prompt`` as raw text (with the tokenizer's usual special tokens)."""
    if "messages" in prompt:
        if not getattr(tokenizer, "chat_template", None):
            raise EagleError(
                f"prompt {prompt.get('id')!r} has 'messages' but the target's tokenizer has no chat template; "
                'use raw {"prompt": "..."} lines for this target'
            )
        text = tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt["prompt"])["input_ids"]
    if not ids:
        raise EagleError(f"prompt {prompt.get('id')!r} is empty after tokenization: remove it from the file")
    return [int(i) for i in ids]


def load_prompt_sets(cfg: EvalConfig, tokenizer: Any) -> list[tuple[str, list[tuple[str, list[int]]]]]:
    """``[(set name, [(prompt id, token ids), ...]), ...]`` for every entry of ``cfg.prompts``."""
    from train.sources import load_prompts

    out = []
    for name, spec in zip(_set_names(cfg.prompts), cfg.prompts):
        prompts = load_prompts(spec)
        if not prompts:
            raise EagleError(
                f"prompts file {spec!r} holds no prompts: add JSONL lines or drop it from eval.prompts"
            )
        if cfg.max_prompts is not None:
            prompts = prompts[: cfg.max_prompts]
        out.append((name, [(str(p["id"]), prompt_token_ids(p, tokenizer)) for p in prompts]))
    return out


def eos_token_ids(target: Any) -> list[int]:
    """The ids that end generation: the generation config's / model config's EOS ids plus the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(target.model, "generation_config", None), target.config, target.tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value if v is not None)
    return sorted(ids)


# ------------------------------------------------------------------------------------------- runs


@dataclass
class PromptRun:
    """The three methods' results on one prompt."""

    set_name: str
    prompt_id: str
    prompt_tokens: int
    spec: GenerationResult
    plain: GenerationResult | None = None
    lookup_tokens: list[int] | None = None
    lookup_time: float = 0.0
    prompt_ids: list[int] | None = None
    mismatch: dict[str, Any] | None = None  # eagle.exactness.diagnose_mismatch, greedy runs that differ
    chain: GenerationResult | None = None  # speculative decoding with a chain of eval.chain_depth drafts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cut_at_eos(tokens: list[int], eos: Sequence[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@torch.no_grad()
def prompt_lookup_generate(
    model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int, num_tokens: int, eos: Sequence[int]
) -> tuple[list[int], float]:
    """transformers' prompt-lookup decoding (greedy): (new tokens cut to max_new_tokens and after EOS, seconds)."""
    device = model.get_input_embeddings().weight.device
    ids = input_ids.to(device)
    pad = eos[0] if eos else getattr(model.config, "pad_token_id", None)
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        prompt_lookup_num_tokens=num_tokens,
        eos_token_id=list(eos) or None,
        pad_token_id=pad,
    )
    _sync(device)
    seconds = time.perf_counter() - t0
    return _cut_at_eos(out[0, ids.shape[1] :].tolist()[:max_new_tokens], eos), seconds


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _run_prompt(
    cfg: EvalConfig,
    target: Any,
    drafter: Drafter,
    tree_cfg: TreeConfig,
    ids: torch.Tensor,
    eos: list[int],
    seed: int,
    order: Sequence[str],
    max_new_tokens: int,
) -> dict[str, Any]:
    """Run the enabled methods in ``order`` on one prompt; returns their raw results by method."""
    sampling = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, eos_token_ids=eos)
    out: dict[str, Any] = {}
    for method in order:
        if method == "speculative":
            out[method] = speculative_generate(
                target.model,
                drafter,
                ids,
                max_new_tokens,
                tree_cfg,
                generator=_generator(target.device, seed),
                **sampling,
            )
        elif method == "chain":
            chain = TreeConfig(policy="chain", depth=cfg.chain_depth, lookup_ngram=0)
            out[method] = speculative_generate(
                target.model, drafter, ids, max_new_tokens, chain, generator=_generator(target.device, seed),
                **sampling,
            )
        elif method == "plain":
            out[method] = plain_generate(
                target.model, ids, max_new_tokens, generator=_generator(target.device, seed), **sampling
            )
        else:
            out[method] = prompt_lookup_generate(
                target.model, ids, max_new_tokens, cfg.prompt_lookup_num_tokens, eos
            )
    return out


# ------------------------------------------------------------------------------------------ summary


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(runs: Sequence[PromptRun], temperature: float) -> dict[str, Any]:
    """Aggregate prompt runs into the report fields (see the module docstring for the definitions)."""
    steps = [n for r in runs for n in r.spec.accept_lengths]
    forwards = sum(r.spec.target_forwards for r in runs)
    depth = max((len(r.spec.accepted_per_depth) for r in runs), default=0)
    per_depth = [0] * depth
    for r in runs:
        for d, n in enumerate(r.spec.accepted_per_depth):
            per_depth[d] += n
    hist = [0] * (depth + 1)
    for n in steps:
        if n - 1 >= len(hist):
            hist.extend([0] * (n - len(hist)))
        hist[n - 1] += 1
    new_tokens = sum(len(r.spec.tokens) for r in runs)
    spec_time = sum(r.spec.total_time for r in runs)
    tps = _rate(new_tokens, spec_time)
    per_prompt_tau = [r.spec.mean_accept_length for r in runs if r.spec.accept_lengths]

    plains = [r.plain for r in runs if r.plain is not None]
    base_tps = None
    if plains and len(plains) == len(runs):
        base_tps = _rate(sum(len(p.tokens) for p in plains), sum(p.total_time for p in plains))
    greedy = temperature <= 0 and base_tps is not None
    matches = [r.spec.tokens == r.plain.tokens for r in runs] if greedy else []

    lookups = [r for r in runs if r.lookup_tokens is not None]
    pld_tps = None
    if lookups and len(lookups) == len(runs):
        pld_tps = _rate(sum(len(r.lookup_tokens) for r in lookups), sum(r.lookup_time for r in lookups))
    pld_matches = (
        [r.lookup_tokens == r.plain.tokens for r in lookups] if greedy and pld_tps is not None else []
    )

    return {
        "num_prompts": len(runs),
        "new_tokens": new_tokens,
        "target_forwards": forwards,
        "prefill_forwards": len(runs),
        "acceptance_length_mean": sum(steps) / len(steps) if steps else None,
        "acceptance_length_median": statistics.median(per_prompt_tau) if per_prompt_tau else None,
        "per_depth_acceptance": [n / forwards for n in per_depth] if forwards else [0.0] * depth,
        "accept_length_histogram": hist,
        "tokens_per_second": tps,
        "baseline_tokens_per_second": base_tps,
        "speedup": _ratio(tps, base_tps),
        "greedy_match_rate": sum(matches) / len(matches) if matches else None,
        "prompt_lookup_tokens_per_second": pld_tps,
        "prompt_lookup_speedup": _ratio(pld_tps, base_tps),
        "prompt_lookup_match_rate": sum(pld_matches) / len(pld_matches) if pld_matches else None,
        "time_s": spec_time,
        "draft_time_s": sum(r.spec.draft_time for r in runs),
        "verify_time_s": sum(r.spec.verify_time for r in runs),
        "prefill_time_s": sum(r.spec.prefill_time for r in runs),
        "baseline_time_s": sum(p.total_time for p in plains) if plains else None,
        "prompt_lookup_time_s": sum(r.lookup_time for r in lookups) if lookups else None,
        **chain_summary([r.chain for r in runs], base_tps),
    }


def chain_summary(chains: Sequence[GenerationResult | None], base_tps: float | None) -> dict[str, Any]:
    """The ``chain_*`` report fields: acceptance of a chain of drafts (what an engine without trees gets)."""
    if not chains or any(c is None for c in chains):
        return {"chain_acceptance_length_mean": None, "chain_per_depth_acceptance": None,
                "chain_tokens_per_second": None, "chain_speedup": None}
    steps = [n for c in chains for n in c.accept_lengths]
    forwards = sum(c.target_forwards for c in chains)
    depth = max(len(c.accepted_per_depth) for c in chains)
    per_depth = [sum(c.accepted_per_depth[d] for c in chains if d < len(c.accepted_per_depth))
                 for d in range(depth)]
    tps = _rate(sum(len(c.tokens) for c in chains), sum(c.total_time for c in chains))
    return {
        "chain_acceptance_length_mean": sum(steps) / len(steps) if steps else None,
        "chain_per_depth_acceptance": [n / forwards for n in per_depth] if forwards else [0.0] * depth,
        "chain_accepted_per_depth": per_depth,
        "chain_target_forwards": forwards,
        "chain_tokens_per_second": tps,
        "chain_speedup": _ratio(tps, base_tps),
    }


def _prompt_record(r: PromptRun) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "set": r.set_name,
        "id": r.prompt_id,
        "prompt_tokens": r.prompt_tokens,
        "new_tokens": len(r.spec.tokens),
        "target_forwards": r.spec.target_forwards,
        "acceptance_length_mean": r.spec.mean_accept_length if r.spec.accept_lengths else None,
        "time_s": r.spec.total_time,
    }
    if r.plain is not None:
        rec["baseline_new_tokens"] = len(r.plain.tokens)
        rec["baseline_time_s"] = r.plain.total_time
        rec["first_mismatch"] = first_mismatch(r.spec.tokens, r.plain.tokens)
        if r.mismatch is not None:
            for key in ("logit_gap", "near_tie", "plain_token", "spec_token"):
                rec[f"first_mismatch_{key}"] = r.mismatch[key]
    if r.chain is not None:
        rec["chain_acceptance_length_mean"] = r.chain.mean_accept_length if r.chain.accept_lengths else None
        rec["chain_time_s"] = r.chain.total_time
        if r.plain is not None:
            rec["chain_first_mismatch"] = first_mismatch(r.chain.tokens, r.plain.tokens)
    if r.lookup_tokens is not None:
        rec["prompt_lookup_new_tokens"] = len(r.lookup_tokens)
        rec["prompt_lookup_time_s"] = r.lookup_time
    return rec


# ------------------------------------------------------------------------------------------ checks


def _load_head(draft: str, target: Any, dtype: torch.dtype) -> torch.nn.Module:
    from eagle.export import CONFIG_FILE, load_exported_head

    folder = Path(draft)
    if "{run_dir}" in str(draft):
        raise EagleError(f"eval.draft {draft!r} still holds '{{run_dir}}': set run_dir or pass --draft DIR")
    if not (folder / CONFIG_FILE).is_file():
        raise EagleError(
            f"no exported draft head at {folder} ({CONFIG_FILE} missing): make one with `eagle train` then "
            f"`eagle export` (or `eagle demo`), or pass --draft with an exported draft directory"
        )
    return load_exported_head(folder, target, dtype=dtype)


def _head_dtype(drafter: Drafter) -> str | None:
    """The dtype the head's weights compute in (None for drafters without a head)."""
    head = getattr(drafter, "head", None)
    if head is None:
        return None
    return str(next(p for p in head.parameters() if p.is_floating_point()).dtype).removeprefix("torch.")


def _tree_tokens(tree: TreeConfig) -> int:
    """Nodes (root included) a verification forward of this tree holds at most (with its lookup branch)."""
    if tree.policy == "chain":
        drafted = tree.depth + 1
    elif tree.policy == "static":
        drafted = len(tree.static_paths or []) + 1
    else:
        drafted = int(tree.total_tokens)
    return drafted + lookup_length(tree)


def _max_positions(target: Any) -> int | None:
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if value else None


def _check_context(sets, max_new_tokens: int, tree_tokens: int, target: Any) -> None:
    limit = _max_positions(target)
    if limit is None:
        return
    for name, prompts in sets:
        for pid, ids in prompts:
            need = len(ids) + max_new_tokens + tree_tokens
            if need > limit:
                raise EagleError(
                    f"prompt {pid!r} of {name} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} and a "
                    f"{tree_tokens}-token tree it needs {need} positions, more than the target's "
                    f"max_position_embeddings={limit}: lower eval.max_new_tokens, use a smaller tree "
                    "(eval.tree.total_tokens / depth) or drop that prompt"
                )


def _tree_report(tree: TreeConfig, requested: Any, autotune: dict | None) -> dict[str, Any]:
    out = asdict(tree)
    out["total_tokens_requested"] = requested
    out["tree_tokens"] = _tree_tokens(tree)
    out["autotune"] = autotune
    return out


# --------------------------------------------------------------------------------------------- I/O


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def print_report_table(report: dict[str, Any], console: Any = None) -> None:
    """One row per prompt set plus overall: tau mean/median, tokens/s (spec, plain, PLD), speedups, match."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    tree = report["tree"]
    size = f", {tree['total_tokens']} tokens" if tree["policy"] == "dynamic" else ""
    if tree.get("lookup_ngram"):
        size += f" + lookup branch of {tree['lookup_tokens']}" if tree.get("lookup_tokens") else " + lookup branch"
    table = Table(
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
        collapse_padding=True,
        title=f"eagle eval: {report['target']} on {report['device']} (tree {tree['policy']}, depth {tree['depth']}"
        f"{size}, T={report['settings']['temperature']})",
    )
    table.add_column("set", no_wrap=True)
    for col in (
        "n",
        "tau\nmean",
        "tau\nmedian",
        "tau\nchain",
        "tok/s\nspec",
        "tok/s\nplain",
        "tok/s\nPLD",
        "speedup",
        "PLD\nspeedup",
        "greedy\nmatch",
    ):
        table.add_column(col, justify="right")
    rows = list(report["prompt_sets"].items()) + [("overall", report["overall"])]
    for name, s in rows:
        table.add_row(
            name,
            str(s["num_prompts"]),
            _fmt(s["acceptance_length_mean"]),
            _fmt(s["acceptance_length_median"]),
            _fmt(s.get("chain_acceptance_length_mean")),
            _fmt(s["tokens_per_second"], ".1f"),
            _fmt(s["baseline_tokens_per_second"], ".1f"),
            _fmt(s["prompt_lookup_tokens_per_second"], ".1f"),
            _fmt(s["speedup"], ".2f", "x"),
            _fmt(s["prompt_lookup_speedup"], ".2f", "x"),
            _fmt(None if s["greedy_match_rate"] is None else 100 * s["greedy_match_rate"], ".0f", "%"),
        )
    console.print(table)


# ------------------------------------------------------------------------------------------ evaluate


def evaluate(
    cfg: EvalConfig,
    target: Any,
    head: torch.nn.Module | None = None,
    drafter: Drafter | None = None,
    console: Any = None,
) -> dict[str, Any]:
    """Evaluate a draft head on ``target`` (an :class:`eagle.targets.Target`); writes and returns the report.

    The head comes from ``cfg.draft`` (an exported draft directory) unless ``head`` (attached to the target) or
    a ready ``drafter`` (e.g. :class:`eagle.drafter.OracleDrafter`) is given. Every check that can fail (draft
    head, prompts, context length) runs before any generation. With ``cfg.cpu_prepack`` on a CPU the target's
    (and head's) linear layers are swapped in place for prepacked ones: the target stays usable for inference.
    A head loaded from ``cfg.draft`` computes in ``cfg.draft_dtype``; a ``head`` given in memory keeps its own.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cfg.validate()
    deadline = Deadline(cfg.max_minutes)
    console = console or Console()
    if "{run_dir}" in str(cfg.report):
        raise EagleError(f"eval.report {cfg.report!r} still holds '{{run_dir}}': set run_dir or pass --out")
    if target.tokenizer is None:
        raise EagleError(f"target {target.name!r} has no tokenizer: load it with eagle.targets.load_target")

    head_path = "in-memory"
    if drafter is None:
        if head is None:
            dtype = resolve_draft_dtype(cfg.draft_dtype, target.device, target.dtype)
            head = _load_head(cfg.draft, target, dtype)
            head_path = str(cfg.draft)
        else:
            from eagle.export import check_target_match

            check_target_match(head.config, target)
        drafter = HeadDrafter(head)
    elif head is None:
        head_path = f"in-memory {type(drafter).__name__}"

    draft_dtype = _head_dtype(drafter)  # before prepacking, which swaps the head's fp32 layers
    prepacked = 0
    if cfg.cpu_prepack and target.device.type == "cpu":
        from eagle.targets import prepack_for_cpu

        prepacked = prepack_for_cpu(target.model)  # changes the caller's target: documented above
        if isinstance(drafter, HeadDrafter):
            prepacked += prepack_for_cpu(drafter.head)

    sets = load_prompt_sets(cfg, target.tokenizer)
    eos = eos_token_ids(target)
    tree_cfg = replace(cfg.tree).validate()
    requested = tree_cfg.total_tokens
    auto = tree_cfg.policy == "dynamic" and requested == "auto"
    longest = max(len(ids) for _, prompts in sets for _, ids in prompts)
    limit = _max_positions(target)
    candidates = sorted(set(cfg.autotune_candidates))
    if auto:
        if limit is not None:
            fitting = [c for c in candidates if longest + cfg.max_new_tokens + c <= limit]
            candidates = fitting or candidates[:1]  # none fits: the context check below says why
        _check_context(sets, cfg.max_new_tokens, min(candidates), target)
    else:
        _check_context(sets, cfg.max_new_tokens, _tree_tokens(tree_cfg), target)

    autotune = None
    first = torch.tensor([sets[0][1][0][1]])
    if auto:
        # warm up first: the calibration is ~10 steps, and a cold start (lazy CUDA kernel loading, allocator
        # growth) would inflate the draft time it measures and favour larger trees
        for i in range(cfg.warmup):
            _run_prompt(cfg, target, drafter, replace(tree_cfg, total_tokens=max(candidates)), first, eos,
                        cfg.seed + i, ["speculative"], min(cfg.max_new_tokens, 16))
        calib = [torch.tensor([prompts[0][1]]) for _, prompts in sets][:2]
        if len(calib) < 2 and len(sets[0][1]) > 1:
            calib.append(torch.tensor([sets[0][1][1][1]]))
        mean_len = int(statistics.mean(len(ids) for _, p in sets for _, ids in p))
        with console.status("autotuning the tree size (total_tokens: auto)"):
            tuned = autotune_total_tokens(
                target.model,
                drafter,
                calib,
                tree_cfg,
                candidates=candidates,
                cache_len=mean_len + cfg.max_new_tokens // 2,
                eos_token_ids=eos,
            )
        tree_cfg = replace(tree_cfg, total_tokens=tuned.chosen)
        autotune = tuned.to_dict()
        autotune["max_tree_nodes"] = max_tree_nodes(tree_cfg.depth, tree_cfg.top_k)

    # a chain of eval.chain_depth that is the tree itself needs no second run (its result is reused below)
    chain_is_tree = tree_cfg == TreeConfig(policy="chain", depth=cfg.chain_depth, lookup_ngram=0).validate()
    methods = (
        ["speculative"]
        + (["chain"] if cfg.chain_depth and not chain_is_tree else [])
        + (["plain"] if cfg.baseline else [])
        + (["prompt_lookup"] if cfg.prompt_lookup else [])
    )
    for i in range(cfg.warmup):
        _run_prompt(
            cfg, target, drafter, tree_cfg, first, eos, cfg.seed + i, methods, min(cfg.max_new_tokens, 16)
        )

    runs: dict[str, list[PromptRun]] = {name: [] for name, _ in sets}
    queue = _interleaved(sets)
    prompt_time = 0.0  # seconds spent on the prompts run so far (a time limit skips what would not fit)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    t_start = time.perf_counter()
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("eval", total=len(queue))
        for k, (name, pid, ids) in enumerate(queue):
            done = sum(len(r) for r in runs.values())
            if done and len(runs[name]) >= MIN_PROMPTS_PER_SET and not deadline.fits(prompt_time / done):
                progress.advance(task)
                continue  # no time for another prompt of the mean length so far; this set has its minimum
            t0 = deadline.elapsed()
            progress.update(task, description=f"eval {name} {pid}")
            order = methods[k % len(methods) :] + methods[: k % len(methods)]
            res = _run_prompt(
                cfg,
                target,
                drafter,
                tree_cfg,
                torch.tensor([ids]),
                eos,
                cfg.seed + k,
                order,
                cfg.max_new_tokens,
            )
            lookup = res.get("prompt_lookup")
            runs[name].append(
                PromptRun(
                    name,
                    pid,
                    len(ids),
                    res["speculative"],
                    res.get("plain"),
                    lookup[0] if lookup else None,
                    lookup[1] if lookup else 0.0,
                    prompt_ids=ids,
                    chain=res["speculative"] if cfg.chain_depth and chain_is_tree else res.get("chain"),
                )
            )
            prompt_time += deadline.elapsed() - t0
            progress.advance(task)
            if not console.is_terminal:  # a log file gets no live bar: one line per prompt instead
                spec = res["speculative"]
                console.print(
                    f"eval {k + 1}/{len(queue)} {name} {pid}: {len(spec.tokens)} tokens, "
                    f"tau {spec.mean_accept_length:.2f} ({(time.perf_counter() - t_start) / 60:.1f} min)",
                    highlight=False,
                    soft_wrap=True,  # one line per prompt, however long its id
                )

    all_runs = [r for name, _ in sets for r in runs[name]]
    wall_time = time.perf_counter() - t_start  # the prompts' runs, without the referee's forwards below
    mismatches = None
    if cfg.temperature <= 0 and all_runs and all(r.plain is not None for r in all_runs):
        for r in all_runs:  # one target forward per differing prompt says: near-tie (numerics) or bug
            r.mismatch = diagnose_mismatch(target.model, r.prompt_ids, r.plain.tokens, r.spec.tokens)
        mismatches = mismatch_summary([r.mismatch for r in all_runs], target.dtype)
    skipped = len(queue) - len(all_runs)
    if skipped:
        console.print(
            f"[yellow]eval: the time limit ({cfg.max_minutes:.1f} min, eval.max_minutes) ran out; {skipped} of {len(queue)} prompts were not "
            "run (the report counts the prompts that were)[/]"
        )
    report: dict[str, Any] = {
        "engine": "hf",
        "target": target.name,
        "target_fingerprint": target.fingerprint,
        "head": head_path,
        "head_config": head.config.to_dict() if head is not None else None,
        "device": str(target.device),
        "device_name": torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else "cpu",
        "dtype": str(target.dtype).removeprefix("torch."),
        "torch_version": torch.__version__,
        "transformers_version": _transformers_version(),
        "eagle_version": _package_version("eagle-heads"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "settings": {
            "prompts": list(cfg.prompts),
            "max_prompts": cfg.max_prompts,
            "max_minutes": cfg.max_minutes,
            "prompts_not_run": skipped,
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "top_k": cfg.top_k,
            "seed": cfg.seed,
            "warmup": cfg.warmup,
            "baseline": cfg.baseline,
            "prompt_lookup": cfg.prompt_lookup,
            "prompt_lookup_num_tokens": cfg.prompt_lookup_num_tokens,
            "chain_depth": cfg.chain_depth,
            "eos_token_ids": eos,
            "cpu_prepacked_layers": prepacked,
            "draft_dtype": draft_dtype,
        },
        "tree": _tree_report(tree_cfg, requested, autotune),
        "prompt_sets": {name: summarize(runs[name], cfg.temperature) for name, _ in sets},
        "overall": summarize(all_runs, cfg.temperature),
        "greedy_mismatches": mismatches,
        "wall_time_s": wall_time,
        "prompts": [_prompt_record(r) for r in all_runs],
    }
    from eagle.plots import write_eval_plots

    out = Path(cfg.report)
    plots = write_eval_plots(report, out.parent)
    report["plots"] = {k: Path(v).name for k, v in plots.items()}
    write_json_atomic(report, out)
    print_report_table(report, console)
    note = mismatch_note(mismatches) if mismatches else None
    if note:
        console.print(note)
    console.print(f"report: {out}")
    return report


def _interleaved(sets: Sequence[tuple[str, list[tuple[str, list[int]]]]]) -> list[tuple[str, str, list[int]]]:
    """(set, prompt id, token ids) taking one prompt from each set in turn, so a time limit cuts every set alike."""
    queue = []
    for i in range(max((len(p) for _, p in sets), default=0)):
        queue += [(name, *prompts[i]) for name, prompts in sets if i < len(prompts)]
    return queue


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None
