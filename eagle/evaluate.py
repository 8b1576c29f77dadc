"""``eagle eval``: speculative decoding with a draft head vs plain decoding vs prompt lookup, on prompt sets.

For every prompt the methods run back to back (their order rotating from prompt to prompt, so that slow drifts
of the machine hit them alike), each timed with the wall clock:

1. speculative decoding with the head and its tree (:func:`eagle.speculate.speculative_generate`);
2. the same with a chain of ``eval.chain_depth`` drafts: what an engine without tree attention (vLLM) gets;
3. plain decoding of the same target, one forward per token (:func:`eagle.speculate.plain_generate`);
4. transformers' prompt-lookup decoding (``generate(prompt_lookup_num_tokens=N, do_sample=False)``).

:func:`evaluate` reads as its steps: build the drafter, load the prompt sets, plan the tree (autotuning its size
when asked), warm up, run the prompts (within the time limit), referee greedy differences, write the report.
The report's fields are :mod:`eagle.metrics`'s. At temperature 0 every prompt whose speculative output differs
from plain decoding is refereed by :mod:`eagle.exactness` (a near-tie of the target's logits, i.e. numerics, or a
bug); a bug makes :func:`evaluate` raise :class:`eagle.errors.CheckFailed` once the report is written.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from eagle.autotune import DEFAULT_CANDIDATES, autotune_total_tokens, max_tree_nodes
from eagle.cache import has_recurrent_state
from eagle.deadline import Deadline, check_minutes
from eagle.devices import model_device, sync
from eagle.drafter import Drafter, HeadDrafter, LookupDrafter, resolve_draft_dtype
from eagle.errors import CheckFailed, EagleError
from eagle.exactness import diagnose_mismatch, mismatch_note, mismatch_summary
from eagle.fileio import write_json_atomic
from eagle.metrics import PromptRun, breakdown, print_report_table, prompt_record, summarize, versions
from eagle.prompts import EvalPrompt, load_eval_prompts, next_turn
from eagle.sampling import Sampling, check_warping
from eagle.speculate import plain_generate, speculative_generate, verification_mode
from eagle.speed_model import fit_speed_model, speed_points
from eagle.tree import TreeConfig, as_chain, deepest_node, verify_tokens
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
    max_new_tokens: int = 128  # tokens generated per prompt
    temperature: float = 0.0  # 0 = greedy (outputs must equal plain decoding)
    top_p: float = 1.0  # nucleus sampling (temperature > 0)
    top_k: int = 0  # top-k sampling (temperature > 0; 0 = off)
    seed: int = 0  # sampling seed, the same for every method
    tree: TreeConfig = field(default_factory=TreeConfig)
    autotune_candidates: list[int] = field(default_factory=lambda: list(DEFAULT_CANDIDATES))  # tree sizes tried by tree.total_tokens=auto
    baseline: bool = True  # plain decoding of the target (speedup, greedy match)
    prompt_lookup: bool = True  # transformers' prompt-lookup decoding, for comparison
    prompt_lookup_num_tokens: int = 10  # tokens transformers' prompt-lookup baseline proposes
    # also decode with a chain of this many drafts (no tree, no lookup branch): what an engine without tree
    # attention (vLLM, num_speculative_tokens) gets from the same head, shown beside the tree's figures; 0 = off
    chain_depth: int = 3
    report: str = "{run_dir}/eval/report.json"  # where the report (and its plots) go
    warmup: int = 1  # untimed warm-up generations per method before the timed ones
    # on a CPU: swap the target's and the head's fp32 linear layers for oneDNN ones with prepacked weights
    # (eagle.targets.prepack_for_cpu) -- tree verification gets cheaper; plain decoding uses the same model
    cpu_prepack: bool = False
    # the dtype the draft head (loaded from ``draft``) computes in: auto = bfloat16 on a CPU with native bf16
    # instructions (drafting ~1.6x faster, same acceptance), else the target's; null = the
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
        check_warping(self.temperature, self.top_p, self.top_k, "eval.")
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




# ------------------------------------------------------------------------------------------ methods


def _cut_at_eos(tokens: list[int], eos: Sequence[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@torch.no_grad()
def prompt_lookup_generate(
    model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int, num_tokens: int, eos: Sequence[int]
) -> tuple[list[int], float]:
    """transformers' prompt-lookup decoding (greedy): (new tokens cut to max_new_tokens and after EOS, seconds).

    transformers refuses prompt lookup on targets with a recurrent state: they get the same method (n-grams of up
    to 2 tokens, ``num_tokens`` proposed) in eagle's loop, which verifies them in chains."""
    if has_recurrent_state(model):
        tree = TreeConfig(policy="chain", depth=1, lookup_ngram=2, lookup_tokens=num_tokens)
        result = speculative_generate(model, LookupDrafter(), input_ids, max_new_tokens, tree,
                                      Sampling(eos_token_ids=tuple(eos)))
        return result.tokens, result.total_time
    device = model_device(model)
    ids = input_ids.to(device)
    pad = eos[0] if eos else getattr(model.config, "pad_token_id", None)
    sync(device)
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
    sync(device)
    seconds = time.perf_counter() - t0
    return _cut_at_eos(out[0, ids.shape[1] :].tolist()[:max_new_tokens], eos), seconds


class _Methods:
    """The enabled methods of one evaluation, run on one prompt at a time."""

    def __init__(self, cfg: EvalConfig, target: Any, drafter: Drafter, tree_cfg: TreeConfig, sampling: Sampling):
        self.cfg = cfg
        self.target = target
        self.drafter = drafter
        self.tree_cfg = tree_cfg
        self.sampling = sampling
        self.chain_cfg = TreeConfig(policy="chain", depth=max(cfg.chain_depth, 1), lookup_ngram=0).validate()
        # a chain that is the tree itself needs no second run (its result is reused)
        self.chain_is_tree = bool(cfg.chain_depth) and tree_cfg == self.chain_cfg
        self.names = (
            ["speculative"]
            + (["chain"] if cfg.chain_depth and not self.chain_is_tree else [])
            + (["plain"] if cfg.baseline else [])
            + (["prompt_lookup"] if cfg.prompt_lookup else [])
        )

    def run(self, ids: torch.Tensor, seed: int, order: Sequence[str], max_new_tokens: int) -> dict[str, Any]:
        """Run the methods in ``order`` on one prompt; returns their raw results by method."""
        model, device = self.target.model, self.target.device
        out: dict[str, Any] = {}
        for method in order:
            generator = torch.Generator(device=device).manual_seed(seed)
            if method in ("speculative", "chain"):
                tree = self.tree_cfg if method == "speculative" else self.chain_cfg
                out[method] = speculative_generate(model, self.drafter, ids, max_new_tokens, tree, self.sampling,
                                                   generator)
            elif method == "plain":
                out[method] = plain_generate(model, ids, max_new_tokens, self.sampling, generator)
            else:
                out[method] = prompt_lookup_generate(model, ids, max_new_tokens, self.cfg.prompt_lookup_num_tokens,
                                                     list(self.sampling.eos_token_ids))
        if self.chain_is_tree:
            out["chain"] = out["speculative"]
        return out

    def warm_up(self, ids: torch.Tensor) -> None:
        """Untimed generations, so that first-call costs (allocations, lazy kernels) stay out of the timings."""
        for i in range(self.cfg.warmup):
            self.run(ids, self.cfg.seed + i, self.names, min(self.cfg.max_new_tokens, 16))


# ------------------------------------------------------------------------------------------ steps


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


def _max_positions(target: Any) -> int | None:
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if value else None


def _check_context(sets, max_new_tokens: int, tree_tokens: int, target: Any) -> None:
    limit = _max_positions(target)
    if limit is None:
        return
    for name, prompts in sets:
        for p in prompts:
            need = len(p.ids) + max_new_tokens + tree_tokens
            if need > limit:
                turn = f" (turn {p.turn})" if p.turn > 1 else ""
                raise EagleError(
                    f"prompt {p.id!r}{turn} of {name} has {len(p.ids)} tokens; with max_new_tokens={max_new_tokens} and a "
                    f"{tree_tokens}-token tree it needs {need} positions, more than the target's "
                    f"max_position_embeddings={limit}: lower eval.max_new_tokens, use a smaller tree "
                    "(eval.tree.total_tokens / depth) or drop that prompt"
                )


def _tree_report(tree: TreeConfig, requested: Any, autotune: dict | None, verification: str) -> dict[str, Any]:
    out = asdict(tree)
    out["verification"] = verification  # tree, or chain for targets with a recurrent state
    out["total_tokens_requested"] = requested
    out["tree_tokens"] = verify_tokens(tree)
    out["autotune"] = autotune
    return out


def _make_drafter(cfg: EvalConfig, target: Any, head: torch.nn.Module | None, drafter: Drafter | None
                  ) -> tuple[Drafter, torch.nn.Module | None, str]:
    """The drafter to evaluate: ``drafter`` as given, a ``head`` in memory, or the export in ``cfg.draft``."""
    if drafter is not None:
        return drafter, head, "in-memory" if head is not None else f"in-memory {type(drafter).__name__}"
    if head is None:
        dtype = resolve_draft_dtype(cfg.draft_dtype, target.device, target.dtype)
        head = _load_head(cfg.draft, target, dtype)
        return HeadDrafter(head), head, str(cfg.draft)
    from eagle.export import check_target_match

    check_target_match(head.config, target)
    return HeadDrafter(head), head, "in-memory"


def _prepack(cfg: EvalConfig, target: Any, drafter: Drafter) -> int:
    """oneDNN prepacked linear layers on a CPU (``eval.cpu_prepack``); changes the caller's target in place."""
    if not (cfg.cpu_prepack and target.device.type == "cpu"):
        return 0
    from eagle.targets import prepack_for_cpu

    packed = prepack_for_cpu(target.model)
    if isinstance(drafter, HeadDrafter):
        packed += prepack_for_cpu(drafter.head)
    return packed


def _plan_tree(cfg: EvalConfig, target: Any, drafter: Drafter, sets: list, sampling: Sampling,
               console: Any) -> tuple[TreeConfig, dict | None]:
    """The tree to decode with: ``eval.tree``, its size measured on this device when it is ``auto``. Checks
    first that every prompt fits the target's context with it."""
    tree_cfg = replace(cfg.tree).validate()
    if verification_mode(target.model) == "chain":  # one path is verified: no tree size to tune
        tree_cfg = as_chain(tree_cfg)
    if not (tree_cfg.policy == "dynamic" and tree_cfg.total_tokens == "auto"):
        _check_context(sets, cfg.max_new_tokens, verify_tokens(tree_cfg), target)
        return tree_cfg, None
    candidates = sorted(set(cfg.autotune_candidates))
    limit = _max_positions(target)
    longest = max(len(p.ids) for _, prompts in sets for p in prompts)
    if limit is not None:
        candidates = [c for c in candidates if longest + cfg.max_new_tokens + c <= limit] or candidates[:1]
    _check_context(sets, cfg.max_new_tokens, min(candidates), target)
    # warm up first: the calibration is ~10 steps, and a cold start (lazy CUDA kernel loading, allocator
    # growth) would inflate the draft time it measures and favour larger trees
    warm = _Methods(replace(cfg, chain_depth=0, baseline=False, prompt_lookup=False), target, drafter,
                    replace(tree_cfg, total_tokens=max(candidates)), sampling)
    warm.warm_up(torch.tensor([sets[0][1][0][1]]))
    calib = [torch.tensor([prompts[0][1]]) for _, prompts in sets][:2]
    if len(calib) < 2 and len(sets[0][1]) > 1:
        calib.append(torch.tensor([sets[0][1][1][1]]))
    mean_len = int(statistics.mean(len(p.ids) for _, prompts in sets for p in prompts))
    with console.status("autotuning the tree size (total_tokens: auto)"):
        tuned = autotune_total_tokens(target.model, drafter, calib, tree_cfg, candidates=candidates,
                                      cache_len=mean_len + cfg.max_new_tokens // 2,
                                      eos_token_ids=list(sampling.eos_token_ids))
    tree_cfg = replace(tree_cfg, total_tokens=tuned.chosen)
    autotune = tuned.to_dict()
    autotune["max_tree_nodes"] = max_tree_nodes(tree_cfg.depth, tree_cfg.top_k)
    return tree_cfg, autotune


def _interleaved(sets: Sequence[tuple[str, list[EvalPrompt]]]) -> list[tuple[str, EvalPrompt]]:
    """(set, prompt) taking one prompt from each set in turn, so a time limit cuts every set alike."""
    queue = []
    for i in range(max((len(p) for _, p in sets), default=0)):
        queue += [(name, prompts[i]) for name, prompts in sets if i < len(prompts)]
    return queue


def _follow_up(cfg: EvalConfig, methods: _Methods, name: str, prompt: EvalPrompt, res: dict[str, Any]
               ) -> tuple[str, EvalPrompt]:
    """The prompt's next turn, asked after the target's own answer: plain decoding's where it ran (the
    speculative one equals it at T=0, and is a sample of the target's at T > 0 otherwise)."""
    tokens = (res.get("plain") or res["speculative"]).tokens
    answer = methods.target.tokenizer.decode(tokens, skip_special_tokens=True).strip()
    turn = next_turn(prompt, answer, methods.target.tokenizer)
    _check_context([(name, [turn])], cfg.max_new_tokens, verify_tokens(methods.tree_cfg), methods.target)
    return name, turn


def _run_prompts(cfg: EvalConfig, methods: _Methods, sets: list, deadline: Deadline, console: Any
                 ) -> tuple[list[PromptRun], int]:
    """Every prompt through every method (the order rotating) while ``deadline`` allows, a question's later
    turns right after its first; returns the runs (set by set) and how many prompt turns the time limit left
    out."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    runs: dict[str, list[PromptRun]] = {name: [] for name, _ in sets}
    queue = _interleaved(sets)
    total = sum(1 + len(p.follow_ups) for _, p in queue)
    prompt_time = 0.0  # seconds spent on the prompts run so far (a time limit skips what would not fit)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("eval", total=total)
        k = 0
        while k < len(queue):
            name, prompt = queue[k]
            progress.advance(task)
            done = sum(len(r) for r in runs.values())
            first_turns = sum(r.turn == 1 for r in runs[name])
            if (prompt.turn == 1 and done and first_turns >= MIN_PROMPTS_PER_SET
                    and not deadline.fits(prompt_time / done)):
                k += 1
                continue  # no time for another prompt of the mean length so far; this set has its minimum
            t0 = deadline.elapsed()
            progress.update(task, description=f"eval {name} {prompt.id}")
            names = methods.names
            order = names[k % len(names):] + names[: k % len(names)]
            res = methods.run(torch.tensor([prompt.ids]), cfg.seed + k, order, cfg.max_new_tokens)
            runs[name].append(_prompt_run(name, prompt, res))
            if prompt.follow_ups:
                queue.insert(k + 1, _follow_up(cfg, methods, name, prompt, res))
            prompt_time += deadline.elapsed() - t0
            k += 1
            if not console.is_terminal:  # a log file gets no live bar: one line per prompt instead
                spec = res["speculative"]
                turn = f" turn {prompt.turn}" if prompt.turn > 1 else ""
                console.print(f"eval {done + 1}/{total} {name} {prompt.id}{turn}: {len(spec.tokens)} tokens, tau "
                              f"{spec.mean_accept_length:.2f} ({deadline.elapsed() / 60:.1f} min)",
                              highlight=False, soft_wrap=True)
    all_runs = [r for name, _ in sets for r in runs[name]]
    return all_runs, total - len(all_runs)


def _prompt_run(name: str, prompt: EvalPrompt, res: dict[str, Any]) -> PromptRun:
    lookup = res.get("prompt_lookup")
    return PromptRun(name, prompt.id, len(prompt.ids), res["speculative"], res.get("plain"),
                     lookup[0] if lookup else None, lookup[1] if lookup else 0.0, prompt_ids=prompt.ids,
                     chain=res.get("chain"), turn=prompt.turn, category=prompt.category)


def _referee(cfg: EvalConfig, target: Any, runs: list[PromptRun]) -> dict[str, Any] | None:
    """At temperature 0, one target forward per prompt whose speculative output differs from plain decoding
    says whether the difference is a near-tie of the target's logits (numerics) or a bug."""
    if cfg.temperature > 0 or not runs or any(r.plain is None for r in runs):
        return None
    for r in runs:
        r.mismatch = diagnose_mismatch(target.model, r.prompt_ids, r.plain.tokens, r.spec.tokens)
    return mismatch_summary([r.mismatch for r in runs], target.dtype)


def _settings(cfg: EvalConfig, skipped: int, eos: list[int], prepacked: int, draft_dtype: str | None) -> dict:
    return {
        "prompts": list(cfg.prompts), "max_prompts": cfg.max_prompts, "max_minutes": cfg.max_minutes,
        "prompts_not_run": skipped, "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
        "top_p": cfg.top_p, "top_k": cfg.top_k, "seed": cfg.seed, "warmup": cfg.warmup, "baseline": cfg.baseline,
        "prompt_lookup": cfg.prompt_lookup, "prompt_lookup_num_tokens": cfg.prompt_lookup_num_tokens,
        "chain_depth": cfg.chain_depth, "eos_token_ids": eos, "cpu_prepacked_layers": prepacked,
        "draft_dtype": draft_dtype,
    }


def run_header(target: Any) -> dict[str, Any]:
    """The report fields that say what ran where: target, device, dtype, library versions, date."""
    return {
        "target": target.name,
        "target_fingerprint": target.fingerprint,
        "device": str(target.device),
        "device_name": torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else "cpu",
        "dtype": str(target.dtype).removeprefix("torch."),
        **versions(),
    }


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
    Raises :class:`CheckFailed` (after writing the report) when a greedy difference is not a near-tie.
    """
    from rich.console import Console

    cfg.validate()
    deadline = Deadline(cfg.max_minutes)  # for the whole evaluation, loading and warm-up included
    console = console or Console()
    if "{run_dir}" in str(cfg.report):
        raise EagleError(f"eval.report {cfg.report!r} still holds '{{run_dir}}': set run_dir or pass --out")
    if target.tokenizer is None:
        raise EagleError(f"target {target.name!r} has no tokenizer: load it with eagle.targets.load_target")
    drafter, head, head_path = _make_drafter(cfg, target, head, drafter)
    draft_dtype = _head_dtype(drafter)  # before prepacking, which swaps the head's fp32 layers
    prepacked = _prepack(cfg, target, drafter)
    sets = load_eval_prompts(cfg.prompts, target.tokenizer, cfg.max_prompts)
    eos = eos_token_ids(target)
    sampling = Sampling(cfg.temperature, cfg.top_p, cfg.top_k, tuple(eos))
    requested = cfg.tree.total_tokens
    tree_cfg, autotune = _plan_tree(cfg, target, drafter, sets, sampling, console)
    methods = _Methods(cfg, target, drafter, tree_cfg, sampling)
    methods.warm_up(torch.tensor([sets[0][1][0][1]]))
    t_start = time.perf_counter()
    runs, skipped = _run_prompts(cfg, methods, sets, deadline, console)
    wall_time = time.perf_counter() - t_start  # the prompts' runs, without the referee's forwards
    mismatches = _referee(cfg, target, runs)
    if skipped:
        console.print(f"[yellow]eval: the time limit ({cfg.max_minutes:.1f} min, eval.max_minutes) ran out; {skipped} "
                      f"of {len(runs) + skipped} prompts were not run (the report counts the prompts that were)[/]")
    report: dict[str, Any] = {
        "engine": "hf", **run_header(target), "head": head_path,
        "head_config": head.config.to_dict() if head is not None else None,
        "settings": _settings(cfg, skipped, eos, prepacked, draft_dtype),
        "tree": _tree_report(tree_cfg, requested, autotune, verification_mode(target.model)),
        "prompt_sets": {name: summarize([r for r in runs if r.set_name == name], cfg.temperature)
                        for name, _ in sets},
        "overall": summarize(runs, cfg.temperature),
        "breakdown": breakdown(runs, cfg.temperature),
        "speed_model": fit_speed_model(speed_points(runs), deepest_node(tree_cfg) + 1),
        "greedy_mismatches": mismatches,
        "wall_time_s": wall_time,
        "prompts": [prompt_record(r) for r in runs],
    }
    _write_report(report, Path(cfg.report), console)
    return report


def _write_report(report: dict[str, Any], out: Path, console: Any) -> None:
    """The report with its plots, the table, the referee's note; CheckFailed when the referee found a bug."""
    from eagle.plots import write_eval_plots

    plots = write_eval_plots(report, out.parent)
    report["plots"] = {k: Path(v).name for k, v in plots.items()}
    write_json_atomic(report, out)
    print_report_table(report, console)
    mismatches = report.get("greedy_mismatches")
    note = mismatch_note(mismatches) if mismatches else None
    if note:
        console.print(note)
    console.print(f"report: {out}")
    if mismatches and (mismatches["not_near_ties"] or mismatches["length_only"]):
        raise CheckFailed(
            f"speculative decoding emitted tokens the target does not choose on {mismatches['not_near_ties'] + mismatches['length_only']} "
            f"prompt(s) (not near-ties of its logits): a bug; the report {out} names the first difference of each "
            "(first_mismatch* fields)"
        )
