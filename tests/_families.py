"""The families matrix: one tiny random target per decoder family (``eagle.testing.FAMILY_MATRIX``) through every
stage of the product, and the docs table made from the results.

Stages (:data:`STAGES`), each a function of a :class:`Workspace` that raises on failure and returns a short note:

- ``load``: the saved target loads through ``eagle.targets.load_target`` (the attention a CPU user gets) and its
  logits equal the eager reference built in code;
- ``collect``: offline feature collection in padded batches equals each sequence's own unpadded forward (MoE
  routing that depended on the batch or on padding would show here), and the training labels made from the
  stored last feature are the target's own logits (its scale and soft-cap included);
- ``train``: EAGLE-3 steps with training-time test on those features; the loss falls;
- ``online``: the same steps with the target run inside each step give the same losses;
- ``export``: eagle3 and speculators layouts written, loaded back, tensors equal;
- ``greedy``: speculative output equals ``generate`` with the exported head (dynamic tree + lookup branch) and
  with a noisy oracle (drafts accepted and rejected), and so does eagle's plain decoding (the eval's baseline);
- ``sampling``: a speculative run at T=1 from the exported head;
- ``vllm`` (``--vllm`` only, not in the test command: about a minute a family): vLLM serves the eagle3 export and
  its output equals its plain output, or refuses the family with its own message.

``python tests/_families.py [--vllm]`` reruns the matrix and rewrites docs/FAMILIES.md (the test compares them).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "FAMILIES.md"
VLLM_RECORD = ROOT / "benchmarks" / "vllm-families.json"  # what `python tests/_families.py --vllm` found
COST_RECORD = ROOT / "benchmarks" / "chain-verification.json"  # scripts/chain_verification_benchmark.py
STAGES = ("load", "collect", "train", "online", "export", "greedy", "sampling")
TRAIN_STEPS, WARMUP = 12, 3
N_NEW = 24

# stages a family cannot pass, with a piece of the EagleError that must say why (checked, so it stays true)
UNSUPPORTED = {
    "jamba": {
        "greedy": "does not continue the recurrent state",
        "sampling": "does not continue the recurrent state",
    },
}
# vLLM refusals caused by this check's set-up rather than by the family
VLLM_CONTEXT = {
    "llama4": "the tiny target's attention chunks are 8 tokens, so that the tests cross them; Llama 4's are 8,192",
    "qwen3_next": "vLLM's CPU build runs Gated DeltaNet in bfloat16 only, and this check runs float32",
    "qwen3_5": "vLLM's Qwen3.5 module imports torchvision, which the CPU set-up removes because it breaks "
    "`import vllm` on this torch",
}
WHY = {
    "jamba": "transformers' Jamba restarts its Mamba scan from a zero state when a forward reads several tokens "
    "after a cached prefix, so drafts cannot be verified in one pass; eagle detects it and refuses",
}


@dataclass
class Workspace:
    """What one family's stages share: its folder, the eager reference, the loaded target, the data."""

    name: str
    root: Path
    reference: torch.nn.Module
    target: object = None  # eagle.targets.Target, set by the load stage
    data: Path | None = None
    features: Path | None = None
    trained: Path | None = None
    exports: dict | None = None


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-4) -> None:
    gap = float((got.float() - want.float()).abs().max())
    tol = rtol * max(1.0, float(want.abs().max()))
    if gap > tol:
        raise AssertionError(f"largest difference {gap:.3g} > tolerance {tol:.3g}")


def stage_load(ws: Workspace) -> str:
    from _train_worker import save_word_tokenizer

    from eagle.targets import TargetConfig, load_target

    folder = ws.root / "target"
    ws.reference.save_pretrained(folder)
    save_word_tokenizer(folder, ws.reference.config.get_text_config().vocab_size)
    ws.target = load_target(TargetConfig(name=str(folder)))
    ids = torch.randint(3, 256, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _close(ws.target.model(ids).logits, ws.reference(ids).logits)
    return f"attention {ws.target.model.config._attn_implementation}"


def stage_collect(ws: Workspace) -> str:
    from _train_worker import make_prepared

    from eagle.lazy_logits import TargetLogits
    from train.collect import CollectConfig, collect
    from train.shards import FeatureShards

    ws.data = make_prepared(ws.root / "data", n_train=24, n_val=8, length=(10, 40))
    ws.features = ws.root / "features"
    collect(CollectConfig(output_dir=str(ws.features), dtype="float32", shard_tokens=400, batch_tokens=200),
            ws.data, ws.target)
    shards = FeatureShards(ws.features, "train", expected_fingerprint=ws.target.fingerprint)
    labels = TargetLogits(ws.target.model)
    model = ws.target.model
    for i in range(len(shards)):
        item = shards[i]
        ids = item["input_ids"]
        with torch.no_grad():
            out = model(ids[None], output_hidden_states=True)
        aux = torch.cat([out.hidden_states[j] for j in shards.aux_layers], dim=-1)[0]
        _close(item["aux_hidden"], aux, 1e-5)
        _close(item["last_hidden"], out.hidden_states[-1][0], 1e-5)
        with torch.no_grad():
            _close(labels(item["last_hidden"]), out.logits[0])
    return f"{len(shards)} padded rows = one by one"


def _train_cfg(out: Path, **kw):
    from train.trainer import TrainConfig

    base = dict(output_dir=str(out), epochs=100, max_steps=TRAIN_STEPS, batch_size=4, lr=3e-3, warmup_steps=WARMUP,
                ttt_steps=2, log_every=1, eval_every=0, save_every=1000, progress=False, bf16=False)
    return TrainConfig(**{**base, **kw})


def _losses(out: Path) -> list[float]:
    from train.logging import read_metrics

    return [e["loss"] for e in read_metrics(out / "metrics.jsonl") if e["event"] == "train"]


def _fresh_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def stage_train(ws: Workspace) -> str:
    from eagle.heads import HeadConfig
    from train.trainer import train

    ws.trained = ws.root / "train"
    train(target=ws.target, features_dir=ws.features, head=HeadConfig(draft_vocab_size=128),
          cfg=_train_cfg(ws.trained))
    _fresh_accelerate()
    losses = _losses(ws.trained)
    first, last = statistics.mean(losses[:3]), statistics.mean(losses[-3:])
    if not last < first:
        raise AssertionError(f"the loss did not fall: {first:.3f} -> {last:.3f}")
    return f"loss {first:.2f} -> {last:.2f}"


def stage_online(ws: Workspace) -> str:
    from eagle.heads import HeadConfig
    from train.trainer import train

    out = ws.root / "online"
    train(target=ws.target, data_dir=ws.data, head=HeadConfig(draft_vocab_size=128),
          cfg=_train_cfg(out, mode="online", max_steps=WARMUP))
    _fresh_accelerate()
    online, offline = _losses(out), _losses(ws.trained)[:WARMUP]  # equal learning rates up to the warm-up's end
    if len(online) != WARMUP or any(abs(a - b) > 1e-4 * max(1.0, abs(b)) for a, b in zip(online, offline)):
        raise AssertionError(f"online losses {online} differ from offline {offline}")
    return f"{WARMUP} steps = offline"


def stage_export(ws: Workspace) -> str:
    from eagle.export import export_head, load_exported_head
    from eagle.heads import HeadConfig
    from train.checkpoint import load_head_files

    state, cfg = load_head_files(ws.trained / "final")
    head_cfg = HeadConfig.from_dict(cfg)
    ws.exports = {}
    for layout in ("eagle3", "speculators"):
        folder = export_head((state, head_cfg), ws.root / f"export-{layout}", layout=layout, dtype="float32",
                             target=ws.target)
        head = load_exported_head(folder, ws.target)
        for key, value in head.state_dict().items():
            if not torch.equal(value, state[key]):
                raise AssertionError(f"{layout}: {key} changed on the way out and back")
        ws.exports[layout] = folder
    return "eagle3, speculators"


def _prompt(seed: int) -> torch.Tensor:
    """A prompt that repeats itself, so that the lookup branch finds something to propose."""
    part = torch.randint(3, 256, (8,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([part, part[:5]])[None]


def stage_greedy(ws: Workspace) -> str:
    from eagle.drafter import HeadDrafter
    from eagle.export import load_exported_head
    from eagle.sampling import Sampling
    from eagle.speculate import plain_generate, speculative_generate
    from eagle.testing import NoisyOracle
    from eagle.tree import TreeConfig

    model = ws.target.model
    model.generation_config.eos_token_id = None  # run to the length limit
    head = load_exported_head(ws.exports["eagle3"], ws.target)
    tree = TreeConfig("dynamic", depth=4, top_k=3, total_tokens=10, lookup_ngram=2)
    accepted = []
    for seed, drafter in ((0, HeadDrafter(head)), (1, NoisyOracle(model))):
        ids = _prompt(seed)
        want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N_NEW)
        want = want[0, ids.shape[1]:].tolist()
        got = speculative_generate(model, drafter, ids, N_NEW, tree, Sampling())
        if got.tokens != want:
            raise AssertionError(f"speculative output differs from generate with {type(drafter).__name__}")
        if plain_generate(model, ids, N_NEW, Sampling()).tokens != want:  # the baseline eval times
            raise AssertionError("eagle's plain decoding differs from generate")
        accepted += got.accept_lengths[:-1]
    if not (max(accepted) > 1 and min(accepted) < 5):
        raise AssertionError(f"the runs should accept drafts and reject some: accept lengths {accepted}")
    return f"{got.verification} verification, tau {statistics.mean(accepted):.1f}"


def stage_sampling(ws: Workspace) -> str:
    from eagle.drafter import HeadDrafter
    from eagle.export import load_exported_head
    from eagle.sampling import Sampling
    from eagle.speculate import speculative_generate
    from eagle.tree import TreeConfig

    head = load_exported_head(ws.exports["eagle3"], ws.target)
    tree = TreeConfig("dynamic", depth=4, top_k=3, total_tokens=10, lookup_ngram=2)
    got = speculative_generate(ws.target.model, HeadDrafter(head), _prompt(2), N_NEW, tree,
                               Sampling(temperature=1.0), torch.Generator().manual_seed(0))
    vocab = ws.target.vocab_size
    if len(got.tokens) != N_NEW or not all(0 <= t < vocab for t in got.tokens):
        raise AssertionError(f"a T=1 run gave {len(got.tokens)} tokens, some outside the vocabulary?")
    return f"{N_NEW} tokens"


def stage_vllm(ws: Workspace) -> str:
    """vLLM serves the eagle3 export on this CPU (float32, a chain of 3) and its output equals its plain output
    on 4 prompts; refused families keep vLLM's own first error line."""
    from eagle.vllm_engine import EngineSpec, Job, VllmConfig, run_job

    export = str(ws.exports["eagle3"])
    job = Job(kind="decode", target=str(ws.root / "target"), dtype="float32",
              engines=[EngineSpec("plain"), EngineSpec("eagle3", draft=export, num_speculative_tokens=3)],
              prompts=[_prompt(seed)[0].tolist() for seed in range(4)], max_new_tokens=N_NEW, stop_token_ids=[],
              max_model_len=128, vllm=VllmConfig(enforce_eager=True, kv_cache_gb=1, batched=False), warmup=0)
    result = run_job(job, f"vLLM on the tiny {ws.name} target")
    plain, spec = ([r["tokens"] for r in result["engines"][e]["single"]] for e in ("plain", "eagle3"))
    if plain != spec:
        raise AssertionError("vLLM's speculative output differs from its plain output")
    drafted = sum(r["num_draft_tokens"] or 0 for r in result["engines"]["eagle3"]["single"])
    if not drafted:
        raise AssertionError("vLLM drafted nothing")
    return f"serves it: output = plain on {len(plain)} prompts, {drafted} tokens drafted"


def vllm_verdict(results: dict[str, dict]) -> dict:
    """A family's vLLM cell, from the run of :func:`stage_vllm` after the other stages: served, or refused
    with the root cause vLLM gave (:func:`root_cause`)."""
    stage = results.get("vllm")
    if stage is None:
        return {"status": "-", "note": "not run (an earlier stage failed)"}
    if stage["status"] == "pass":
        return {"status": "serves", "note": stage["note"]}
    return {"status": "refuses", "note": root_cause(stage["note"])}


# exception lines that wrap the cause rather than state it
_WRAPPERS = ("Engine core initialization failed", "WorkerProc initialization failed", "EngineCore encountered",
             "Worker failed with error", "Error raised in subprocess", "CalledProcessError", "failed to be inspected",
             "ValidationError")


def root_cause(message: str, limit: int = 200) -> str:
    """The first exception line of a failed vLLM worker that states a cause, from its whole output when the
    message names the log holding it (vLLM prints the cause long before the error that ends the worker)."""
    import re

    found = re.search(r"whole output(?: is in|:) (\S+?\.log)", message)
    log = Path(found.group(1)) if found else None
    lines = log.read_text(errors="replace").splitlines() if log and log.is_file() else message.splitlines()
    for line in lines:
        hit = re.search(r"\b(\w+(?:Error|Exception)): (.+)", line)
        if hit and not any(wrapper in line for wrapper in _WRAPPERS):
            text = f"{hit.group(1)}: {hit.group(2).strip()}"
            return text if len(text) <= limit else text[: limit - 3] + "..."
    return message.splitlines()[0]


STAGE_FUNCTIONS: dict[str, Callable[[Workspace], str]] = {
    "load": stage_load, "collect": stage_collect, "train": stage_train, "online": stage_online,
    "export": stage_export, "greedy": stage_greedy, "sampling": stage_sampling, "vllm": stage_vllm,
}


def run_family(name: str, root: Path, vllm: bool = False) -> dict[str, dict]:
    """Every stage of one family, in order: {stage: {"status": pass | unsupported | fail, "note": ...}}. A stage
    listed in :data:`UNSUPPORTED` must fail with the EagleError it names; a failed stage ends the run. ``vllm``:
    then :func:`stage_vllm` too, as ``"vllm"``."""
    from eagle.testing import family_model

    ws = Workspace(name, root, family_model(name))
    results: dict[str, dict] = {}
    for stage in STAGES:
        results[stage] = _run_stage(ws, stage, UNSUPPORTED.get(name, {}).get(stage))
        if results[stage]["status"] == "fail":
            return results
    if vllm:
        results["vllm"] = _run_stage(ws, "vllm", None)
    return results


def _run_stage(ws: Workspace, stage: str, expected: str | None) -> dict:
    from eagle.errors import EagleError

    try:
        note = STAGE_FUNCTIONS[stage](ws)
        status = "fail" if expected else "pass"
        if expected:
            note = f"expected an error saying {expected!r}, but the stage passed"
    except EagleError as e:
        status = "unsupported" if expected and expected in str(e) else "fail"
        note = str(e)
    except Exception as e:  # noqa: BLE001 -- reported in the table and failed by the test
        status, note = "fail", f"{type(e).__name__}: {e}"
    return {"status": status, "note": note}


# ------------------------------------------------------------------------------------------------ the table


def render_table(results: dict[str, dict[str, dict]], served: dict | None = None) -> str:
    """docs/FAMILIES.md from the matrix results (family -> stage -> result) and the stored vLLM verdicts
    (:data:`VLLM_RECORD`, made by ``python tests/_families.py --vllm``)."""
    from eagle.testing import FAMILY_MATRIX

    served = served if served is not None else _read_vllm_record()
    verdicts = served.get("families", {})
    lines = [
        "# Target families",
        "",
        "<!-- generated by tests/test_families.py (python tests/_families.py rewrites it); do not edit -->",
        "",
        "Every family below is a tiny random target built in code (4 layers, width 64, with the features named "
        "switched on) and taken through every stage on the CPU by the test suite (tests/test_families.py). "
        "**pass**: the stage works and its check holds; **unsupported**: eagle refuses with a clear error (the "
        "reason below the table). Verification: **tree** (one forward over the draft tree) or **chain** (targets "
        "with a recurrent state: one path a step, its state snapshotted and restored; docs/ARCHITECTURE.md). "
        "**vLLM**: whether "
        f"vLLM {served.get('vllm_version', '?')} (CPU build) serves the family's EAGLE-3 export with output equal "
        "to its plain output in float32 (`python tests/_families.py --vllm`, "
        f"{served.get('date', 'not run yet')}).",
        "",
        "| family | kind | features switched on | " + " | ".join(STAGES) + " | verification | vLLM |",
        "|---|---|---|" + "---|" * len(STAGES) + "---|---|",
    ]
    for entry in FAMILY_MATRIX:
        row = results.get(entry.name, {})
        cells = [row.get(stage, {}).get("status", "-") for stage in STAGES]
        greedy = row.get("greedy", {})
        mode = greedy.get("note", "").split(" verification")[0] if greedy.get("status") == "pass" else "-"
        vllm = verdicts.get(entry.name, {}).get("status", "-")
        lines.append(f"| {entry.name} | {entry.kind} | {entry.features} | " + " | ".join(cells)
                     + f" | {mode} | {vllm} |")
    lines += ["", "Unsupported in eagle:", ""]
    lines += [f"- **{name}**: {why}." for name, why in WHY.items()]
    refused = [(name, v["note"]) for name, v in verdicts.items() if v["status"] == "refuses"]
    if refused:
        lines += ["", "Refused by vLLM (the cause it gave; where the cause is this check's set-up rather than the "
                  "family, why):", ""]
        lines += [f"- **{name}**: `{note}`" + (f" ({VLLM_CONTEXT[name]})" if name in VLLM_CONTEXT else "")
                  for name, note in refused]
    return "\n".join(lines + _cost_section()) + "\n"


def _cost_section() -> list[str]:
    """What chain verification costs, from the record of scripts/chain_verification_benchmark.py."""
    import json

    if not COST_RECORD.is_file():
        return []
    record = json.loads(COST_RECORD.read_text())
    rates = sorted({r["draft_accept_rate"] for r in record["rows"]})
    lines = [
        "", "## What chain verification costs", "",
        f"`python scripts/chain_verification_benchmark.py` ({record['date']}, one CPU thread, the tiny targets above, "
        f"{record['max_new_tokens']} new tokens from each of {record['rows'][0]['prompts']} prompts): a scripted "
        f"drafter proposes the target's own greedy continuation, {record['depth']} tokens a step, each wrong with "
        "probability 1 - p, so that tau is set by p and drafting costs nothing. The speedup is over eagle's plain "
        "decoding of the same target, timed beside it prompt by prompt (outputs equal throughout; SE over the "
        "prompts' speedups). Chain "
        "verification pays for its snapshot of the recurrent state every step, for reading the tokens a rejection "
        "left unread in front of the next chain, and for an extra forward whenever more than a chain of them "
        "piled up (replays per step); the attention-only families verify the same chains as trees.",
        "",
        "| family | verification | " + " | ".join(f"p = {p}: tau, speedup ± SE (replays/step)" for p in rates)
        + " |",
        "|---|---|" + "---|" * len(rates),
    ]
    families: dict[str, dict[float, dict]] = {}
    for row in record["rows"]:
        families.setdefault(row["family"], {})[row["draft_accept_rate"]] = row
    for family, by_rate in families.items():
        cells = [f"{r['tau']:.2f}, {r['speedup']:.2f}x ± {r['speedup_se']:.2f} ({r['replays_per_step']:.2f})"
                 for r in (by_rate[p] for p in rates)]
        lines.append(f"| {family} | {next(iter(by_rate.values()))['verification']} | " + " | ".join(cells) + " |")
    return lines


def _read_vllm_record() -> dict:
    import json

    return json.loads(VLLM_RECORD.read_text()) if VLLM_RECORD.is_file() else {}


def main(argv: list[str]) -> int:
    """Rerun the matrix and rewrite docs/FAMILIES.md. ``--vllm [FAMILY ...]``: also serve those families (all
    without names) in vLLM and update their verdicts in its record first (about a minute a family on 2 CPU
    cores)."""
    import datetime
    import tempfile

    from eagle.fileio import write_json_atomic
    from eagle.testing import FAMILY_MATRIX
    from eagle.vllm_engine import vllm_version

    torch.set_num_threads(1)
    with_vllm = argv[:1] == ["--vllm"]
    served = (set(argv[1:]) or {entry.name for entry in FAMILY_MATRIX}) if with_vllm else set()
    record = _read_vllm_record()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for entry in FAMILY_MATRIX:
            results[entry.name] = run_family(entry.name, Path(tmp) / entry.name, vllm=entry.name in served)
            if entry.name in served:
                record.setdefault("families", {})[entry.name] = vllm_verdict(results[entry.name])
            print(entry.name, {k: v["status"] for k, v in results[entry.name].items()}, flush=True)
    if served:
        record.update(vllm_version=vllm_version(), date=datetime.date.today().isoformat())
        write_json_atomic(record, VLLM_RECORD)
    DOC.write_text(render_table(results, record))
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main(sys.argv[1:]))
