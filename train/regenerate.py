"""Regeneration: the target writes the assistant turns itself, so the head learns the target's distribution
rather than the humans'.

Conversations are cut after their first ``regen_max_turns`` assistant turns (0 = every turn) and answered turn by
turn in length-sorted batches, by our batched KV-cache loop (:func:`generate_batch`, which can keep the target's
features as it answers: ``train/regen_features.py``) or by vLLM (``regen_engine: vllm``). Finished answers are
appended to a JSONL file as they are produced, so a killed run resumes where it stopped; batches run in a seeded
random order, so a time limit keeps a random subset of the conversations.

Reasoning targets think: prompts are rendered with ``data.chat_template_kwargs`` (say ``enable_thinking``), and an
answer's ``<think>...</think>`` becomes the turn's ``reasoning_content`` as in records. An answer that reaches
``regen_max_new_tokens`` without a stop token is marked ``cut`` (in the answers file and on the message); unless
``data.on_cut_answer`` keeps it, its conversation is answered no further (prepare then drops or refuses it).
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from eagle.deadline import Deadline
from eagle.devices import model_device
from eagle.errors import EagleError
from eagle.records import Message, split_thinking
from eagle.vllm_engine import VllmConfig
from train.chat_template import drop_thinking, end_of_turn_ids, render
from train.regen_features import CaptureSpec, FeatureCapture, write_batch
from train.shards import STORAGE_DTYPES
from train.sources import Conversation

log = logging.getLogger(__name__)
# test hook: sleep this many seconds before every batch, so a test can kill a run between two batches
SLOW_ENV = "EAGLE_REGEN_SLOW"


class RegenSettings(Protocol):
    """The settings regeneration reads (the ``data:`` section, ``train.prepare.DataConfig``, has them)."""

    max_length: int
    seed: int
    regen_max_new_tokens: int
    regen_temperature: float
    regen_top_p: float
    regen_batch_size: int
    regen_max_turns: int
    regen_dtype: str | None
    regen_engine: str
    vllm: VllmConfig
    chat_template_kwargs: dict[str, Any]
    thinking: str
    on_cut_answer: str


def _regen_slots(messages: list[Message], max_turns: int) -> list[Message]:
    """Cut the conversation after its first ``max_turns`` assistant turns; a trailing prompt gets an empty slot."""
    messages = [dict(m) for m in messages]
    if messages and messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    slots = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if max_turns and len(slots) > max_turns:
        messages = messages[: slots[max_turns - 1] + 1]
    return messages


def _rank_file(path: Path, rank: int) -> Path:
    """Process ``rank``'s own answers file beside ``path``."""
    return path.with_name(f"{path.stem}.r{rank}{path.suffix}")


Answer = tuple[str, bool]  # (text, cut: stopped by regen_max_new_tokens rather than by a stop token)


def read_answers(path: Path, max_new_tokens: int | None = None) -> dict[tuple[str, int], Answer]:
    """Answers of an earlier (maybe killed) run, with their cut marks; a torn last line is ignored. Lines from
    vLLM carry their token count instead: one of ``max_new_tokens`` tokens counts as cut."""
    done: dict[tuple[str, int], Answer] = {}
    if not path.is_file():
        return done
    for line in path.read_text(encoding="utf-8").split("\n"):
        try:
            rec = json.loads(line)
            cut = rec.get("cut")
            if cut is None:
                cut = max_new_tokens is not None and int(rec.get("tokens", 0)) >= max_new_tokens
            done[(rec["id"], int(rec["turn"]))] = (rec["content"], bool(cut))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            continue
    return done


def read_partial(path: Path) -> dict[tuple[str, int], str]:
    """Finished answers' texts of an earlier (maybe killed) run; a torn last line is ignored."""
    return {key: text for key, (text, _) in read_answers(path).items()}


def _answer_line(key: tuple[str, int], answer: Answer) -> str:
    return json.dumps({"id": key[0], "turn": key[1], "content": answer[0], "cut": answer[1]}) + "\n"


def answer_message(text: str, cut: bool, where: str) -> Message:
    """A generated answer as an assistant message: its thinking split off as in records, and marked when cut."""
    reasoning, content = split_thinking(text, where, strict=False)
    message: Message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if cut:
        message["cut"] = True
    return message


def _left_padded(prompts: list[list[int]], pad_id: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, attention mask, position ids) of a left-padded batch: each prompt counts from position 0."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return input_ids, attention, (attention.cumsum(-1) - 1).clamp(min=0)


def _picker(cfg: RegenSettings, device: torch.device, seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Next tokens from a batch of logits: argmax, or a seeded draw from the decoding loop's warped distribution."""
    from eagle.sampling import logits_to_probs

    if cfg.regen_temperature <= 0:
        return lambda logits: logits.argmax(-1)
    generator = torch.Generator(device=device).manual_seed(seed)

    def pick(logits: torch.Tensor) -> torch.Tensor:
        probs = logits_to_probs(logits, float(cfg.regen_temperature), float(cfg.regen_top_p))
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    return pick


def _texts(answers: list[list[int]], stop_ids: set[int], tokenizer: Any, cut: list[bool] | None) -> list[str]:
    """Each answer decoded up to (not including) its first stop token; ``cut`` gets whether it had none."""
    out = []
    for row in answers:
        end = next((j for j, tok in enumerate(row) if tok in stop_ids), len(row))
        out.append(tokenizer.decode(row[:end], skip_special_tokens=True))
        if cut is not None:
            cut.append(end == len(row))
    return out


@torch.no_grad()
def generate_batch(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: list[list[int]],
    cfg: RegenSettings,
    stop_ids: set[int],
    seed: int,
    capture: FeatureCapture | None = None,
    cut: list[bool] | None = None,
) -> list[str]:
    """Answers for a batch of token-id prompts (left padded), decoded up to the first stop token; ``cut`` (a list)
    gets, per answer, whether it reached ``regen_max_new_tokens`` without one.

    A plain KV-cache loop rather than ``model.generate``: rows that have stopped leave the batch (their cache rows
    are dropped), where ``generate`` keeps computing them until the longest answer ends; regeneration is
    compute-bound on a CPU, so that saves real time. Sampling (``regen_temperature > 0``) is seeded per batch so
    that a resumed run writes the same answers.

    With ``capture`` the forwards also return hidden states, kept per row (``train/regen_features.py``); an
    answer cut at ``regen_max_new_tokens`` then gets one more forward, for its last token's features.
    """
    from transformers import DynamicCache

    from eagle.targets import cache_kwarg, last_logits_only

    device = model_device(model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop_ids)
    input_ids, attention, positions = _left_padded(prompts, pad_id, device)
    pick = _picker(cfg, device, seed)
    cache, kw = DynamicCache(config=model.config), cache_kwarg(model)
    states = {"output_hidden_states": capture is not None}
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                **{kw: cache}, **last_logits_only(model), **states)
    if capture is not None:
        capture.prefill(input_ids, attention, out.hidden_states)
    can_drop = hasattr(cache, "batch_select_indices")
    live = torch.arange(len(prompts), device=device)  # the prompt each batch row answers
    answers: list[list[int]] = [[] for _ in prompts]
    last, nxt = positions[:, -1], pick(out.logits[:, -1])
    for step in range(cfg.regen_max_new_tokens):
        for row, token in zip(live.tolist(), nxt.tolist()):
            if not answers[row] or answers[row][-1] not in stop_ids:
                answers[row].append(token)
        ended = torch.tensor([answers[row][-1] in stop_ids for row in live.tolist()], device=device)
        final = step == cfg.regen_max_new_tokens - 1
        # a captured answer cut by the token limit still needs its last token read (its features), one that
        # ended with a stop token does not (the losses never read the stop token's own features)
        if bool(ended.all()) or (final and capture is None):
            break
        if can_drop and bool(ended.any()):  # (a cache that cannot drop rows keeps them: capture skips them)
            rows = (~ended).nonzero().squeeze(-1)
            cache.batch_select_indices(rows)
            live, nxt, attention, last, ended = live[rows], nxt[rows], attention[rows], last[rows], ended[rows]
        attention = torch.cat([attention, attention.new_ones(len(live), 1)], dim=-1)
        last = last + 1
        out = model(input_ids=nxt[:, None], attention_mask=attention, position_ids=last[:, None], use_cache=True,
                    **{kw: cache}, **states)
        if capture is not None:
            keep = (~ended).nonzero().squeeze(-1)
            capture.step(live[keep].tolist(), nxt[keep], [h[keep] for h in out.hidden_states])
        if final:
            break
        nxt = pick(out.logits[:, -1])
    return _texts(answers, stop_ids, tokenizer, cut)


class _Regeneration:
    """One regeneration run: the conversations being answered, the answers so far (and their file), and the
    clock. A turn at a time (:meth:`run_turn`), a batch at a time (:meth:`answer_batch`)."""

    def __init__(self, conversations: list[Conversation], tokenizer: Any, model: torch.nn.Module | None,
                 cfg: RegenSettings, partial_path: Path | None, deadline: Deadline | None,
                 capture: tuple[Path, CaptureSpec] | None, engine_target: tuple[str, str] | None, state: Any):
        self.convs = [c._replace(messages=_regen_slots(c.messages, cfg.regen_max_turns)) for c in conversations]
        self.tokenizer, self.model, self.cfg = tokenizer, model, cfg
        self.partial_path, self.deadline, self.capture, self.engine_target = partial_path, deadline, capture, engine_target
        self.state = state  # this process among those of the launch (train.launch.process_state)
        self.rank, self.world = state.process_index, state.num_processes
        self.done = self._read_answers()
        if self.done:
            log.info("regeneration: resuming with %d finished answers from %s", len(self.done), partial_path)
        self.stop_ids = end_of_turn_ids(tokenizer)
        self.slots = [[i for i, m in enumerate(c.messages) if m["role"] == "assistant"] for c in self.convs]
        self.cut = [False] * len(self.convs)  # prompt reached max_length (or time ran out): no further turns
        self.timed_out = 0  # turns left unanswered by the time limit
        self.generated = 0  # batches generated here (the first always runs)
        self.spent = 0.0  # seconds spent generating
        # each process appends to its own file (rank 0 merges them at the end): writers never interleave
        own = partial_path if partial_path is None or self.world == 1 else _rank_file(partial_path, self.rank)
        self.sink = own.open("a", encoding="utf-8") if own else None
        if self.sink and self.sink.tell() and not own.read_bytes().endswith(b"\n"):
            self.sink.write("\n")  # a killed run may have left half a line: start a fresh one

    def _read_answers(self) -> dict[tuple[str, int], Answer]:
        """The answers every process has logged so far (this run's and a killed run's)."""
        if self.partial_path is None:
            return {}
        limit = self.cfg.regen_max_new_tokens
        done = read_answers(self.partial_path, limit)
        for path in sorted(self.partial_path.parent.glob(f"{self.partial_path.stem}.r*{self.partial_path.suffix}")):
            done.update(read_answers(path, limit))
        return done

    def merge(self) -> None:
        """Rank 0 gathers every process's answers into the answers file (the others' files go)."""
        if self.partial_path is None or self.world == 1 or self.rank != 0:
            return
        known = read_answers(self.partial_path)
        extra = {k: v for k, v in self._read_answers().items() if k not in known}
        with self.partial_path.open("a", encoding="utf-8") as sink:
            for key, answer in sorted(extra.items()):
                sink.write(_answer_line(key, answer))
        for path in self.partial_path.parent.glob(f"{self.partial_path.stem}.r*{self.partial_path.suffix}"):
            path.unlink()

    def _prompts(self, turn: int) -> tuple[list[tuple[int, int]], list[list[int]]]:
        """(conversation, message) of every answer this turn asks for, and the token ids of its prompt."""
        items = [(ci, s[turn]) for ci, s in enumerate(self.slots) if len(s) > turn and not self.cut[ci]]
        prompts = []
        for ci, mi in items:
            before = self.convs[ci].messages[:mi]
            before = drop_thinking(before) if getattr(self.cfg, "thinking", "keep") == "drop" else before
            text = render(self.tokenizer, before, add_generation_prompt=True, where=self.convs[ci].id,
                          template_kwargs=getattr(self.cfg, "chat_template_kwargs", None))
            prompts.append(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return items, prompts

    def _cut_from(self, ci: int, mi: int, keep_empty: bool) -> None:
        """End conversation ``ci`` at message ``mi``: kept as an empty answer, or dropped with what follows."""
        if keep_empty:
            self.convs[ci].messages[mi] = {"role": "assistant", "content": ""}
            del self.convs[ci].messages[mi + 1 :]
        else:
            del self.convs[ci].messages[mi:]
        self.cut[ci] = True

    def answer_batch(self, turn: int, b: int, items: list, prompts: list, batch: list[int]) -> None:
        """Our loop's answers for one batch, logged to the answers file (features kept when capturing)."""
        t0 = self.deadline.elapsed() if self.deadline is not None else 0.0
        slow = float(os.environ.get(SLOW_ENV, "0") or 0)
        if slow > 0:
            time.sleep(slow)
        self.generated += 1
        grab = None
        if self.capture is not None:
            spec = self.capture[1]
            grab = FeatureCapture(self.model, list(spec.aux_layers), STORAGE_DTYPES[spec.dtype])
        # the whole batch is regenerated so that its padding and seed match the first run's
        cut: list[bool] = []
        texts = generate_batch(self.model, self.tokenizer, [prompts[j] for j in batch], self.cfg, self.stop_ids,
                               seed=self.cfg.seed * 1_000_003 + turn * 10_007 + b, capture=grab, cut=cut)
        answers = list(zip(texts, cut))
        keys = [(self.convs[items[j][0]].id, turn) for j in batch]
        if grab is not None:
            write_batch(self.capture[0], f"batch-{turn}-{b:05d}", keys, grab.rows(), self.capture[1])
        for key, answer in zip(keys, answers):
            if key not in self.done:
                self.done[key] = answer
                if self.sink:
                    self.sink.write(_answer_line(key, answer))
        if self.sink:
            self.sink.flush()
        if self.deadline is not None:
            self.spent += self.deadline.elapsed() - t0

    def run_turn(self, turn: int, bar: Any) -> None:
        """Answer every conversation's ``turn``-th assistant message that time allows; cut the others there.

        Across processes, process r answers the batches ``b % world == r`` of the one global plan (so each batch,
        its padding and its seed are those of a one-process run), and all of them read every answer before the
        next turn."""
        items, prompts = self._prompts(turn)
        fits = [j for j in range(len(items)) if len(prompts[j]) < self.cfg.max_length]
        for j in set(range(len(items))) - set(fits):  # the prompt fills max_length: nothing after it trains
            self._cut_from(*items[j], keep_empty=True)
        bar.update(len(items) - len(fits))
        # each batch is length-sorted (little padding); their order is random so that a time limit keeps a
        # random subset of the conversations rather than the shortest ones
        order = sorted(fits, key=lambda j: (len(prompts[j]), j))
        size = self.cfg.regen_batch_size
        batches = [order[b : b + size] for b in range(0, len(order), size)]
        shuffled = list(range(len(batches)))
        random.Random(self.cfg.seed * 1_000_003 + turn).shuffle(shuffled)
        missing = [b for b in shuffled if any((self.convs[items[j][0]].id, turn) not in self.done for j in batches[b])]
        if self.cfg.regen_engine == "vllm":  # answers every prompt it has time for
            keyed = [({"id": self.convs[items[j][0]].id, "turn": turn}, prompts[j]) for b in missing
                     for j in batches[b] if (self.convs[items[j][0]].id, turn) not in self.done]
            self.done.update(_vllm_answers(keyed, self.tokenizer, self.cfg, self.engine_target, self.partial_path,
                                           self.deadline, bar))
        else:
            for b in (b for b in missing if b % self.world == self.rank):
                if self.generated and self.deadline is not None and not self.deadline.fits(self.spent / self.generated):
                    break  # no new batch unless one of the mean duration so far ends in time
                self.answer_batch(turn, b, items, prompts, batches[b])
                bar.update(len(batches[b]))
        if self.world > 1:
            if self.sink:
                self.sink.flush()
            self.state.wait_for_everyone()
            self.done = self._read_answers()
        self._apply(turn, items, [batches[b] for b in shuffled], bar)

    def _put(self, ci: int, mi: int, turn: int) -> None:
        """The answer in its slot (the record's own answer, thinking and tool calls go); after a cut answer the
        conversation goes no further unless ``on_cut_answer`` keeps such answers (prepare drops or refuses it)."""
        conv = self.convs[ci]
        text, cut = self.done[(conv.id, turn)]
        conv.messages[mi] = answer_message(text, cut, f"{conv.id} turn {turn}")
        if cut and getattr(self.cfg, "on_cut_answer", "keep") != "keep":
            del conv.messages[mi + 1 :]
            self.cut[ci] = True

    def _apply(self, turn: int, items: list, batches: list[list[int]], bar: Any) -> None:
        """Put the answers in place; a batch left without them (the time limit) ends its conversations there."""
        unanswered = 0
        for batch in batches:
            if any((self.convs[items[j][0]].id, turn) not in self.done for j in batch):
                for j in batch:  # out of time: this turn and the rest of the conversation go
                    self._cut_from(*items[j], keep_empty=False)
                unanswered += len(batch)
                continue
            for j in batch:
                self._put(*items[j], turn)
        self.timed_out += unanswered
        bar.n = bar.total - unanswered  # what was answered, here or by another process
        if unanswered:
            # the bar stops where the answers stopped instead of filling up with skipped turns
            bar.set_postfix_str(f"time limit: {unanswered} unanswered", refresh=False)
        bar.refresh()


def regenerate(
    conversations: list[Conversation],
    tokenizer: Any,
    model: torch.nn.Module | None,
    cfg: RegenSettings,
    partial_path: Path | None = None,
    deadline: Deadline | None = None,
    capture: tuple[Path, CaptureSpec] | None = None,
    engine_target: tuple[str, str] | None = None,
    state: Any = None,
) -> list[Conversation]:
    """Replace assistant turns by the model's own answers, turn by turn, in length-sorted batches.

    Each conversation keeps its first ``cfg.regen_max_turns`` assistant turns (0 = all); a conversation that ends
    with a prompt gets an answer appended. Later turns see the regenerated earlier ones. A turn whose prompt is
    already ``max_length`` tokens long is left empty (nothing after it could be trained on). Answers are appended
    to ``partial_path`` as they are made, and answers found there are reused.

    Batches run in a seeded random order. Once ``deadline`` cannot fit another batch (of the mean duration so far)
    no new one starts (the first always runs): conversations without an answer are cut before their unanswered
    turn, and those left without any answer are not returned.

    ``capture`` = (folder, spec): keep the target's hidden states of every generated batch there
    (``train/regen_features.py``), each batch's file written before its answers are logged.

    With ``cfg.regen_engine`` vllm, ``engine_target`` = (target folder, dtype) is what vLLM loads (``model`` is
    not used): it answers each turn's prompts in the same random batch order, and the batches it had no time for
    are cut alike.

    ``state``: the processes of a launch (``train.launch.process_state``); every process calls this with the same
    conversations, answers its share of the batches, and returns the same result.
    """
    from tqdm.auto import tqdm

    from train.launch import OneProcess

    state = state if state is not None else OneProcess()
    if state.num_processes > 1 and cfg.regen_engine == "vllm":
        raise EagleError("data.regen_engine=vllm runs in one process: launch prepare plainly and set "
                         "data.vllm.data_parallel_size to use several GPUs")
    run = _Regeneration(conversations, tokenizer, model, cfg, partial_path, deadline, capture, engine_target, state)
    try:
        for turn in range(max((len(s) for s in run.slots), default=0)):
            total = sum(len(s) > turn and not c for s, c in zip(run.slots, run.cut))
            with tqdm(total=total, unit="conv", desc=f"regenerating turn {turn + 1}", mininterval=1.0,
                      disable=not state.is_main_process) as bar:
                run.run_turn(turn, bar)
    finally:
        if run.sink:
            run.sink.close()
    state.wait_for_everyone()
    run.merge()
    if run.timed_out:
        log.warning(
            "regeneration: the time limit (%.1f min) ran out with %d turns unanswered; those turns and what follows "
            "them are left out (raise data.regen_max_minutes, or unset it, to answer them all)",
            deadline.minutes, run.timed_out,
        )
    return [c for c in run.convs if any(m["role"] == "assistant" for m in c.messages)]


def _vllm_answers(
    keyed: list[tuple[dict[str, Any], list[int]]],
    tokenizer: Any,
    cfg: RegenSettings,
    engine_target: tuple[str, str] | None,
    partial_path: Path | None,
    deadline: Deadline | None,
    bar: Any,
) -> dict[tuple[str, int], Answer]:
    """Answers for ``keyed`` (key, prompt ids) written by vLLM in chunks of ``regen_batch_size`` prompts until
    the deadline; appended to ``partial_path`` (resumable) and returned by (conversation id, turn)."""
    import tempfile

    from eagle.vllm_engine import EngineSpec, Job, generate_answers

    if not keyed:
        return {}
    if engine_target is None:
        raise EagleError("data.regen_engine=vllm needs the target's folder and dtype (engine_target)")
    target_dir, dtype = engine_target
    answers = partial_path or Path(tempfile.mkdtemp(prefix="eagle-regen-")) / "answers.jsonl"
    longest = max(len(p) for _, p in keyed)
    job = Job(
        kind="generate", target=target_dir, dtype=cfg.regen_dtype or dtype, engines=[EngineSpec("regen")],
        prompts=[p for _, p in keyed], keys=[k for k, _ in keyed], max_new_tokens=cfg.regen_max_new_tokens,
        stop_token_ids=sorted(end_of_turn_ids(tokenizer)), max_model_len=longest + cfg.regen_max_new_tokens + 8,
        vllm=cfg.vllm, seed=cfg.seed, temperature=float(cfg.regen_temperature), top_p=float(cfg.regen_top_p),
        answers_path=str(answers), chunk=cfg.regen_batch_size,
        time_limit_s=deadline.remaining() if deadline is not None and deadline.limited else None,
    )
    def progress(line: str) -> None:  # the bar itself moves as the answers are taken in, after the worker
        if line.startswith("vllm: ") and " answered" in line:
            bar.set_postfix_str(f"vLLM {line.split()[1]}")

    result = generate_answers(job, "regeneration with vLLM (data.regen_engine=vllm)", progress)
    log.info("regeneration (vLLM): %d answers, %d tokens in %.0f s (+%.0f s loading)", result["answered"],
             result["tokens"], result["generate_seconds"], result["load_seconds"])
    wanted = {(k["id"], k["turn"]) for k, _ in keyed}
    done = read_answers(answers, cfg.regen_max_new_tokens)  # cut: as many tokens as allowed
    return {key: answer for key, answer in done.items() if key in wanted}
