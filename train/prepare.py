"""Data preparation (``eagle prepare``): chat sources -> token ids + assistant loss masks, saved as HF datasets.

Pipeline: load every source (``train/sources.py``), shuffle them together with the seed, cap at
``max_conversations``, optionally **regenerate** the assistant turns with the target itself, render each
conversation with the target's chat template, mask everything but the assistant turns, apply ``max_length``,
split train/val, and write ``<output_dir>/{train,val}`` (``save_to_disk``; columns ``input_ids``, ``loss_mask``),
``split_ids.json`` and ``prepare_meta.json`` atomically.

The loss mask covers each assistant message's content plus the end-of-turn token that closes it (not the role
header). It is found from character offsets in the rendered text, so it works with any chat template; no
``{% generation %}`` markers are needed.

Regeneration (``regenerate: true``) replaces assistant turns by the target's own answers, turn by turn, so the
draft head learns the target's distribution rather than the humans'. To bound the cost, conversations are cut
after their first ``regen_max_turns`` assistant turns (default 1: one answer per conversation; 0 = every turn).
At ~25 tokens/s (SmolLM2-135M, 2-core CPU, uncontended) a 256-token answer takes ~10 s unbatched, so regenerating
thousands of conversations is a GPU job or an overnight CPU one. Finished answers are appended to
``<output_dir>/regen-<key>.jsonl`` as they are produced, so a killed run resumes where it stopped. The file is
kept: re-preparing with another ``val_fraction`` or ``on_overlong`` reuses the answers.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle.deadline import Deadline, check_minutes
from eagle.errors import EagleError
from eagle.targets import resolve_target
from eagle.vllm_engine import VllmConfig
from train.collect import STORAGE_DTYPES, CollectConfig
from train.regen_features import CaptureSpec, FeatureCapture, capture_dir, write_batch
from train.sources import Conversation, Message, load_source, parse_source_spec, source_stamp

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ON_OVERLONG = ("truncate", "skip", "error")
REGEN_DTYPES = ("float32", "bfloat16", "float16")
REGEN_ENGINES = ("hf", "vllm")


@dataclass
class DataConfig:
    """The ``data:`` section of a run config."""

    sources: list[str] = field(default_factory=lambda: ["chitchat"])
    max_conversations: int | None = None  # total cap, after shuffling all sources together
    max_length: int = 1024  # tokens per conversation
    val_fraction: float = 0.05
    seed: int = 0
    output_dir: str = "runs/demo/data"
    regenerate: bool = False  # replace assistant turns by the target's own answers
    regen_max_new_tokens: int = 256
    regen_temperature: float = 0.0  # 0 = greedy
    regen_top_p: float = 1.0
    regen_batch_size: int = 16
    regen_max_turns: int = 1  # keep (and regenerate) only the first K assistant turns; 0 = all
    # the dtype the target answers in (null = as loaded). "bfloat16" on a CPU with bf16 units (prepacked) answers
    # ~2x faster than fp32 with answers of the same kind (TUNING.md run 24); the features and labels still come
    # from the target as loaded for collect/train
    regen_dtype: str | None = None
    # stop regenerating once prepare has run this long and keep the conversations answered so far (batches run
    # in a seeded random order, so the kept ones are a random subset); null = no limit. The demo sets it from
    # its time budget. Not part of the output's identity: a cut output is reused by runs with a limit.
    regen_max_minutes: float | None = None
    on_overlong: str = "truncate"  # truncate: keep the first max_length tokens | skip: drop | error: raise
    # keep the target's hidden states while it regenerates (the collect section's aux layers and dtype), so that
    # `eagle collect` copies them instead of running the target over the data again (train/regen_features.py);
    # costs the features' disk space twice until the regeneration folder is deleted
    capture_features: bool = False
    # who writes the answers: hf (our batched loop, which can keep the features) or vllm (its continuous
    # batching; eagle collect then computes the features); data.vllm: tensor / data parallel sizes on GPUs
    regen_engine: str = "hf"
    vllm: VllmConfig = field(default_factory=VllmConfig)

    def validate(self) -> DataConfig:
        """Raise EagleError naming the bad field; return self when all is well."""

        def bad(name: str, rule: str) -> EagleError:
            return EagleError(f"data.{name} must be {rule} (got {getattr(self, name)!r})")

        if (
            not isinstance(self.sources, list)
            or not self.sources
            or not all(isinstance(s, str) and s.strip() for s in self.sources)
        ):
            raise bad("sources", "a non-empty list of source specs such as ['chitchat', 'stdlib-code:500']")
        if self.max_conversations is not None and (
            not isinstance(self.max_conversations, int) or self.max_conversations < 1
        ):
            raise bad("max_conversations", "a positive integer or null (no cap)")
        if not isinstance(self.max_length, int) or self.max_length < 8:
            raise bad("max_length", "an integer >= 8")
        if not isinstance(self.val_fraction, int | float) or not 0.0 <= self.val_fraction < 1.0:
            raise bad("val_fraction", "a number in [0, 1)")
        if not isinstance(self.seed, int):
            raise bad("seed", "an integer")
        if not isinstance(self.output_dir, str) or not self.output_dir.strip():
            raise bad("output_dir", "a non-empty path")
        if not isinstance(self.regenerate, bool):
            raise bad("regenerate", "true or false")
        if not isinstance(self.capture_features, bool):
            raise bad("capture_features", "true or false")
        if not isinstance(self.regen_max_new_tokens, int) or self.regen_max_new_tokens < 1:
            raise bad("regen_max_new_tokens", "a positive integer")
        if not isinstance(self.regen_temperature, int | float) or self.regen_temperature < 0:
            raise bad("regen_temperature", "a number >= 0 (0 = greedy)")
        if not isinstance(self.regen_top_p, int | float) or not 0.0 < self.regen_top_p <= 1.0:
            raise bad("regen_top_p", "a number in (0, 1]")
        if not isinstance(self.regen_batch_size, int) or self.regen_batch_size < 1:
            raise bad("regen_batch_size", "a positive integer")
        if not isinstance(self.regen_max_turns, int) or self.regen_max_turns < 0:
            raise bad("regen_max_turns", "an integer >= 0 (0 = regenerate every assistant turn)")
        if self.regen_dtype is not None and self.regen_dtype not in REGEN_DTYPES:
            raise bad("regen_dtype", f"null (the target's own dtype) or one of {list(REGEN_DTYPES)}")
        check_minutes(self.regen_max_minutes, "data.regen_max_minutes")
        if self.regen_engine not in REGEN_ENGINES:
            raise bad("regen_engine", f"one of {list(REGEN_ENGINES)}")
        self.vllm.validate("data.vllm")
        if self.on_overlong not in ON_OVERLONG:
            raise bad("on_overlong", f"one of {list(ON_OVERLONG)}")
        return self


# ------------------------------------------------------------------------------------------- rendering


def _check_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise EagleError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; use an instruct/chat "
            "target, or set one (tokenizer.chat_template = '<jinja>' and save it, or add 'chat_template' to its "
            "tokenizer_config.json)"
        )


def render(
    tokenizer: Any, messages: list[Message], add_generation_prompt: bool = False, where: str = ""
) -> str:
    """The conversation rendered as text by the tokenizer's chat template."""
    _check_template(tokenizer)
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # jinja raise_exception(...) and friends: the template rejects this conversation
        raise EagleError(
            f"the chat template rejected conversation {where or '?'}: {e}; fix or drop that conversation"
        ) from e


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids of all special tokens (the standard ones plus added tokens flagged special)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for tid, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(tid))
    return ids


def _locate(text: str, content: str, start: int) -> tuple[int, int]:
    """Character span of ``content`` in ``text`` at or after ``start``; templates that trim content also match."""
    pos = text.find(content, start)
    if pos >= 0:
        return pos, pos + len(content)
    stripped = content.strip()
    pos = text.find(stripped, start) if stripped != content else -1
    return (pos, pos + len(stripped)) if pos >= 0 else (-1, -1)


_MARKER = "\u27e6eagle-content\u27e7"


def _marked_start(tokenizer: Any, messages: list[Message], i: int, text: str, where: str) -> int | None:
    """Where message ``i``'s content starts in ``text``, found by rendering the conversation with that content
    replaced by a marker: exact even when the same string also occurs earlier (say in the role header of a
    conversation that opens with an answer). None when the template does not render the content verbatim."""
    marked = [dict(m) for m in messages]
    marked[i]["content"] = _MARKER
    other = render(tokenizer, marked, where=where)
    start = other.find(_MARKER)
    content = messages[i]["content"]
    if start < 0 or other[:start] != text[:start] or text[start : start + len(content)] != content:
        return None
    if text[start + len(content) :] != other[start + len(_MARKER) :]:
        return None
    return start


def assistant_spans(
    tokenizer: Any, messages: list[Message], text: str, where: str = ""
) -> list[tuple[int, int]]:
    """Character spans of the assistant contents in the rendered ``text``.

    Each assistant content is searched after the rendered prefix (the messages before it plus the generation
    prompt), so a string that also occurs in a system prompt or an earlier user turn cannot be mistaken for it.
    """
    spans = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start = _marked_start(tokenizer, messages, i, text, where)
            if start is not None:
                spans.append((start, start + len(message["content"])))
                cursor = start + len(message["content"])
                continue
        if message["role"] == "assistant" and i > 0:
            prefix = render(tokenizer, messages[:i], add_generation_prompt=True, where=where)
            if text.startswith(prefix):  # templates that rewrite history break this; fall back to the cursor
                cursor = max(cursor, len(prefix))
        start, end = _locate(text, message["content"], cursor)
        if start < 0:
            if message["role"] == "assistant":
                raise EagleError(
                    f"conversation {where or '?'}: the chat template changes assistant message {i}'s text, so its "
                    "loss mask cannot be found; use a template that renders message content verbatim"
                )
            continue
        if message["role"] == "assistant":
            spans.append((start, end))
        cursor = end
    return spans


def tokenize_conversation(
    tokenizer: Any, messages: list[Message], specials: set[int] | None = None, where: str = ""
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)``: mask = 1 on assistant content tokens and the end-of-turn token after each."""
    text = render(tokenizer, messages, where=where)
    spans = assistant_spans(tokenizer, messages, text, where)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    specials = special_token_ids(tokenizer) if specials is None else specials
    mask = [0] * len(ids)
    n, t = len(ids), 0
    for start, end in spans:
        while t < n and offsets[t][1] <= start:
            t += 1
        while end > start and t < n and offsets[t][0] < end:  # tokens overlapping the content
            mask[t] = 1
            t += 1
        # the end-of-turn: the first special token after the content, past whitespace only
        k = t
        while k < n and ids[k] not in specials and not text[offsets[k][0] : offsets[k][1]].strip():
            k += 1
        if k < n and ids[k] in specials:
            for j in range(t, k + 1):
                mask[j] = 1
            t = k + 1
    return ids, mask


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """Tokens that end an assistant turn under this template (plus eos): where generation must stop."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ids, mask = tokenize_conversation(tokenizer, messages)
    specials = special_token_ids(tokenizer)
    stop = {i for i, m in zip(ids, mask) if m and i in specials}
    if getattr(tokenizer, "eos_token_id", None) is not None:
        stop.add(int(tokenizer.eos_token_id))
    return stop


# ---------------------------------------------------------------------------------------- regeneration


def _regen_slots(messages: list[Message], max_turns: int) -> list[Message]:
    """Cut the conversation after its first ``max_turns`` assistant turns; a trailing prompt gets an empty slot."""
    messages = [dict(m) for m in messages]
    if messages and messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    slots = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if max_turns and len(slots) > max_turns:
        messages = messages[: slots[max_turns - 1] + 1]
    return messages


def _read_partial(path: Path) -> dict[tuple[str, int], str]:
    """Finished answers of an earlier (maybe killed) run; a torn last line is ignored."""
    done: dict[tuple[str, int], str] = {}
    if not path.is_file():
        return done
    for line in path.read_text(encoding="utf-8").split("\n"):
        try:
            rec = json.loads(line)
            done[(rec["id"], int(rec["turn"]))] = rec["content"]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return done


def _model_device(model: torch.nn.Module) -> torch.device:
    return model.get_input_embeddings().weight.device


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    return model.get_input_embeddings().weight.dtype


@torch.no_grad()
def generate_batch(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: list[list[int]],
    cfg: DataConfig,
    stop_ids: set[int],
    seed: int,
    capture: FeatureCapture | None = None,
) -> list[str]:
    """Answers for a batch of token-id prompts (left padded), decoded up to the first stop token.

    A plain KV-cache loop rather than ``model.generate``: rows that have stopped leave the batch (their cache rows
    are dropped), where ``generate`` keeps computing them until the longest answer ends. Regeneration is
    compute-bound on a CPU, so this answers the demo's batches of 64 SmolLM2 prompts 1.25x faster with the same
    greedy tokens (TUNING.md row 27b). Sampling (``regen_temperature > 0``) uses the same warpers as decoding
    (``eagle.verify.logits_to_probs``), seeded per batch so that a resumed run writes the same answers.

    With ``capture`` the forwards also return hidden states, kept per row (``train/regen_features.py``); an
    answer cut at ``regen_max_new_tokens`` then gets one more forward, for its last token's features.
    """
    from transformers import DynamicCache

    from eagle.targets import cache_kwarg, last_logits_only
    from eagle.verify import logits_to_probs

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop_ids)
    width = max(len(p) for p in prompts)
    device = _model_device(model)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # left padding: each prompt counts from 0
    sampling = cfg.regen_temperature > 0
    generator = torch.Generator(device=device).manual_seed(seed) if sampling else None
    kw = cache_kwarg(model)

    def pick(logits: torch.Tensor) -> torch.Tensor:
        if not sampling:
            return logits.argmax(-1)
        probs = logits_to_probs(logits, float(cfg.regen_temperature), float(cfg.regen_top_p))
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    cache = DynamicCache(config=model.config)
    states = {"output_hidden_states": capture is not None}
    out = model(
        input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True, **{kw: cache},
        **last_logits_only(model), **states,
    )
    if capture is not None:
        capture.prefill(input_ids, attention, out.hidden_states)
    can_drop = hasattr(cache, "batch_select_indices")
    live = torch.arange(len(prompts), device=device)  # the prompt each batch row answers
    answers: list[list[int]] = [[] for _ in prompts]
    last = positions[:, -1]
    nxt = pick(out.logits[:, -1])
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
        out = model(
            input_ids=nxt[:, None], attention_mask=attention, position_ids=last[:, None], use_cache=True,
            **{kw: cache}, **states,
        )
        if capture is not None:
            reading = [row for row, done in zip(live.tolist(), ended.tolist()) if not done]
            keep = (~ended).nonzero().squeeze(-1)
            capture.step(reading, nxt[keep], [h[keep] for h in out.hidden_states])
        if final:
            break
        nxt = pick(out.logits[:, -1])
    result = []
    for row in answers:
        end = next((j for j, tok in enumerate(row) if tok in stop_ids), len(row))
        result.append(tokenizer.decode(row[:end], skip_special_tokens=True))
    return result


def regenerate(
    conversations: list[Conversation],
    tokenizer: Any,
    model: torch.nn.Module,
    cfg: DataConfig,
    partial_path: Path | None = None,
    deadline: Deadline | None = None,
    capture: tuple[Path, CaptureSpec] | None = None,
    engine_target: tuple[str, str] | None = None,
) -> list[Conversation]:
    """Replace assistant turns by the model's own answers, turn by turn, in length-sorted batches.

    Each conversation keeps its first ``cfg.regen_max_turns`` assistant turns (0 = all); a conversation that ends
    with a prompt gets an answer appended. Later turns see the regenerated earlier ones. A turn whose prompt is
    already ``max_length`` tokens long is left empty (nothing after it could be trained on). Answers are appended
    to ``partial_path`` as they are made, and answers found there are reused.

    Batches run in a seeded random order. Once ``deadline`` cannot fit another batch (of the mean duration so far)
    no new one starts (the first always runs): conversations
    without an answer are cut before their unanswered turn, and those left without any answer are not returned.

    ``capture`` = (folder, spec): keep the target's hidden states of every generated batch there
    (``train/regen_features.py``), each batch's file written before its answers are logged.

    With ``cfg.regen_engine`` vllm, ``engine_target`` = (target folder, dtype) is what vLLM loads: it answers
    each turn's prompts in the same random batch order, and the batches it had no time for are cut alike.
    """
    from tqdm.auto import tqdm

    convs = [c._replace(messages=_regen_slots(c.messages, cfg.regen_max_turns)) for c in conversations]
    done = _read_partial(partial_path) if partial_path else {}
    if done:
        log.info("regeneration: resuming with %d finished answers from %s", len(done), partial_path)
    stop_ids = end_of_turn_ids(tokenizer)
    slots = [[i for i, m in enumerate(c.messages) if m["role"] == "assistant"] for c in convs]
    cut = [False] * len(convs)  # prompt reached max_length (or time ran out): no further turns
    timed_out = generated = 0  # turns left unanswered by the time limit; batches generated (one at least)
    spent = 0.0  # seconds spent generating
    sink = partial_path.open("a", encoding="utf-8") if partial_path else None
    if sink and sink.tell() and not partial_path.read_bytes().endswith(b"\n"):
        sink.write("\n")  # a killed run may have left half a line: start a fresh one
    try:
        for turn in range(max((len(s) for s in slots), default=0)):
            items = [
                (ci, slots[ci][turn]) for ci in range(len(convs)) if len(slots[ci]) > turn and not cut[ci]
            ]
            prompts = []
            for ci, mi in items:
                text = render(
                    tokenizer, convs[ci].messages[:mi], add_generation_prompt=True, where=convs[ci].id
                )
                prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
            fits = [j for j in range(len(items)) if len(prompts[j]) < cfg.max_length]
            order = sorted(fits, key=lambda j: (len(prompts[j]), j))
            batches = [
                order[b : b + cfg.regen_batch_size] for b in range(0, len(order), cfg.regen_batch_size)
            ]
            bar = tqdm(total=len(items), unit="conv", desc=f"regenerating turn {turn + 1}", mininterval=1.0)
            timed_out_before = timed_out  # the bar counts this turn's unanswered only
            for j in set(range(len(items))) - set(
                fits
            ):  # prompt fills max_length: nothing after it is trained
                ci, mi = items[j]
                convs[ci].messages[mi]["content"] = ""
                del convs[ci].messages[mi + 1 :]
                cut[ci] = True
            bar.update(len(items) - len(fits))
            # each batch is length-sorted (little padding); their order is random so that a time limit keeps a
            # random subset of the conversations rather than the shortest ones
            shuffled = list(range(len(batches)))
            random.Random(cfg.seed * 1_000_003 + turn).shuffle(shuffled)
            if cfg.regen_engine == "vllm":  # answers every prompt it has time for; the loop below cuts the rest
                keyed = [({"id": convs[items[j][0]].id, "turn": turn}, prompts[j])
                         for b in shuffled for j in batches[b] if (convs[items[j][0]].id, turn) not in done]
                if sink:
                    sink.flush()
                done.update(_vllm_answers(keyed, tokenizer, cfg, engine_target, partial_path, deadline, bar))
            for b in shuffled:
                batch = batches[b]
                missing = any((convs[items[j][0]].id, turn) not in done for j in batch)
                out_of_time = generated and deadline is not None and not deadline.fits(spent / generated)
                if missing and (out_of_time or cfg.regen_engine == "vllm"):
                    for j in batch:  # out of time: this turn and the rest of the conversation go
                        ci, mi = items[j]
                        del convs[ci].messages[mi:]
                        cut[ci] = True
                    timed_out += len(batch)
                    # the bar stops where the answers stopped instead of filling up with skipped turns
                    bar.set_postfix_str(f"time limit: {timed_out - timed_out_before} unanswered", refresh=False)
                    continue
                if missing:
                    generated += 1
                    t0 = deadline.elapsed() if deadline is not None else 0.0
                    # the whole batch is regenerated so that its padding and seed match the first run's
                    grab = None
                    if capture is not None:
                        grab = FeatureCapture(model, list(capture[1].aux_layers), STORAGE_DTYPES[capture[1].dtype])
                    answers = generate_batch(
                        model,
                        tokenizer,
                        [prompts[j] for j in batch],
                        cfg,
                        stop_ids,
                        seed=cfg.seed * 1_000_003 + turn * 10_007 + b,
                        capture=grab,
                    )
                    if grab is not None:
                        keys = [(convs[items[j][0]].id, turn) for j in batch]
                        write_batch(capture[0], f"batch-{turn}-{b:05d}", keys, grab.rows(), capture[1])
                    for j, answer in zip(batch, answers):
                        key = (convs[items[j][0]].id, turn)
                        if key not in done:
                            done[key] = answer
                            if sink:
                                sink.write(json.dumps({"id": key[0], "turn": turn, "content": answer}) + "\n")
                    if sink:
                        sink.flush()
                    if deadline is not None:
                        spent += deadline.elapsed() - t0
                for j in batch:
                    ci, mi = items[j]
                    convs[ci].messages[mi]["content"] = done[(convs[ci].id, turn)]
                bar.update(len(batch))
            bar.close()
    finally:
        if sink:
            sink.close()
    if timed_out:
        log.warning(
            "regeneration: the time limit (%.1f min) ran out with %d turns unanswered; those turns and what follows "
            "them are left out (raise data.regen_max_minutes, or unset it, to answer them all)",
            deadline.minutes,
            timed_out,
        )
    return [c for c in convs if any(m["role"] == "assistant" for m in c.messages)]


def _vllm_answers(
    keyed: list[tuple[dict[str, Any], list[int]]],
    tokenizer: Any,
    cfg: DataConfig,
    engine_target: tuple[str, str] | None,
    partial_path: Path | None,
    deadline: Deadline | None,
    bar: Any,
) -> dict[tuple[str, int], str]:
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
    return {key: text for key, text in _read_partial(answers).items() if key in wanted}


# ------------------------------------------------------------------------------------------- pipeline


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    return {
        "name": str(getattr(tokenizer, "name_or_path", "")),
        "vocab": len(tokenizer),
        "chat_template_sha256": hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()[:16],
    }


def _model_fingerprint(model: torch.nn.Module | None) -> str | None:
    if model is None:
        return None
    from eagle.targets import fingerprint

    return fingerprint(model)


def _target_name(target: Any) -> str:
    return str(getattr(target, "name", target))


def _load_models(cfg: DataConfig, target: Any, tokenizer: Any, model: Any) -> tuple[Any, Any]:
    """Tokenizer (always) and model (only for regeneration), loaded through eagle.targets when not given."""
    from eagle import targets

    if cfg.regenerate and model is None:
        if isinstance(target, targets.TargetConfig):
            loaded = targets.load_target(target)
        else:
            cuda = torch.cuda.is_available()
            loaded = targets.load_target(
                target, dtype="bfloat16" if cuda else "float32", device="cuda" if cuda else "cpu"
            )
        model = loaded.model
        tokenizer = tokenizer if tokenizer is not None else loaded.tokenizer
    if tokenizer is None:
        name = target.name if isinstance(target, targets.TargetConfig) else target
        trust = bool(getattr(target, "trust_remote_code", False))
        tokenizer = targets.load_tokenizer(name, trust_remote_code=trust)
    return tokenizer, model


# settings that say where or how long to work, not what to produce
_NOT_IDENTITY = ("output_dir", "regen_max_minutes", "vllm")


def _config_hash(cfg: DataConfig, target: str, tokenizer: Any, model_fp: str | None) -> str:
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_IDENTITY}
    stamps = [source_stamp(s) for s in cfg.sources]  # an edited data file must not count as up to date
    return _sha([FORMAT_VERSION, settings, stamps, target, _tokenizer_identity(tokenizer), model_fp])


def _regen_key(cfg: DataConfig, target: str, tokenizer: Any, model_fp: str | None) -> str:
    """What the regenerated answers depend on (not the split or the overlong policy)."""
    keys = ("sources", "max_conversations", "seed", "max_length")
    settings = {k: getattr(cfg, k) for k in keys}
    settings.update(
        {k: v for k, v in dataclasses.asdict(cfg).items() if k.startswith("regen_") and k not in _NOT_IDENTITY}
    )
    stamps = [source_stamp(s) for s in cfg.sources]
    return _sha([FORMAT_VERSION, settings, stamps, target, _tokenizer_identity(tokenizer), model_fp])


def _capture_plan(
    cfg: DataConfig,
    collect: CollectConfig | None,
    model: Any,
    model_fp: str | None,
    out: Path,
    regen_key: str,
) -> tuple[Path, CaptureSpec] | None:
    """Where and what ``cfg.capture_features`` keeps, or None when it is off or cannot match collection:
    regeneration must run the target in the dtype collection will (``data.regen_dtype`` and
    ``collect.target_dtype``, each defaulting to the target's own)."""
    if not cfg.capture_features:
        return None
    from eagle.targets import check_aux_layers, default_aux_layers

    collect = collect if collect is not None else CollectConfig()
    own = str(_model_dtype(model)).removeprefix("torch.")
    regen_dtype, collect_dtype = cfg.regen_dtype or own, collect.target_dtype or own
    if regen_dtype != collect_dtype:
        log.warning(
            "data.capture_features: not capturing, the target answers in %s (data.regen_dtype) but collects its "
            "features in %s (collect.target_dtype); `eagle collect` computes them. Set both alike to capture",
            regen_dtype, collect_dtype,
        )
        return None
    num_layers = int(model.config.get_text_config().num_hidden_layers)
    layers = default_aux_layers(num_layers) if collect.aux_layers is None else list(collect.aux_layers)
    spec = CaptureSpec.of(str(model_fp), getattr(torch, regen_dtype), check_aux_layers(layers, num_layers),
                          collect.dtype)
    return capture_dir(out, regen_key, spec), spec


def _select(cfg: DataConfig) -> tuple[list[Conversation], dict[str, dict[str, int]]]:
    """All sources, shuffled together with the seed and capped at ``max_conversations``."""
    pool: list[Conversation] = []
    stats: dict[str, dict[str, int]] = {}
    for spec in cfg.sources:
        conversations = load_source(spec, regenerate=cfg.regenerate)
        stats[spec] = {"loaded": len(conversations)}
        pool.extend(conversations)
    ids = Counter(c.id for c in pool)
    if len(ids) < len(pool):
        dup = next(i for i, n in ids.items() if n > 1)
        raise EagleError(f"conversation {dup!r} comes from more than one source; list each source only once")
    random.Random(cfg.seed).shuffle(pool)
    if cfg.max_conversations is not None:
        pool = pool[: cfg.max_conversations]
    for spec in cfg.sources:
        stats[spec]["selected"] = sum(c.source == spec for c in pool)
    return pool, stats


def _encode_all(
    conversations: list[Conversation], tokenizer: Any, cfg: DataConfig
) -> tuple[list[tuple[Conversation, list[int], list[int]]], Counter]:
    """Render + mask + apply max_length; returns kept rows and counts of dropped/truncated conversations."""
    from tqdm.auto import tqdm

    specials = special_token_ids(tokenizer)
    rows = []
    counts: Counter = Counter()
    for conv in tqdm(conversations, unit="conv", desc="tokenizing", mininterval=2.0, disable=None):
        if not any(m["role"] == "assistant" for m in conv.messages):
            counts["no_assistant_turn"] += 1
            continue
        ids, mask = tokenize_conversation(tokenizer, conv.messages, specials, where=conv.id)
        if not any(mask):
            counts["no_assistant_token"] += 1  # e.g. only empty answers without an end-of-turn token
            continue
        if len(ids) > cfg.max_length:
            if cfg.on_overlong == "error":
                raise EagleError(
                    f"conversation {conv.id} from {conv.source!r} has {len(ids)} tokens > data.max_length="
                    f"{cfg.max_length}; raise max_length, or set data.on_overlong to truncate or skip"
                )
            if cfg.on_overlong == "skip":
                counts["overlong_skipped"] += 1
                continue
            ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
            if not any(mask):  # the first answer starts beyond max_length: nothing left to learn from
                counts["overlong_no_assistant_in_window"] += 1
                continue
            counts["truncated"] += 1
        rows.append((conv, ids, mask))
    return rows, counts


def _save_atomic(
    out: Path, splits: dict[str, list[tuple[Conversation, list[int], list[int]]]], meta: dict
) -> None:
    """Write both splits, the id lists and the meta file; meta is removed first and written last (the marker)."""
    import datasets

    features = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "loss_mask": datasets.List(datasets.Value("uint8")),
        }
    )
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".tmp-prepare-{uuid.uuid4().hex[:8]}"
    try:
        for name, rows in splits.items():
            ds = datasets.Dataset.from_dict(
                {"input_ids": [r[1] for r in rows], "loss_mask": [r[2] for r in rows]}, features=features
            )
            ds.save_to_disk(str(tmp / name))
        ids = {name: [r[0].id for r in rows] for name, rows in splits.items()}
        (tmp / "split_ids.json").write_text(json.dumps(ids), encoding="utf-8")
        (tmp / "prepare_meta.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
        (out / "prepare_meta.json").unlink(missing_ok=True)  # the old marker must not vouch for mixed output
        for name in (*splits, "split_ids.json"):
            dest = out / name
            if dest.is_dir():
                trash = out / f".old-{name}-{uuid.uuid4().hex[:8]}"
                dest.rename(trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(tmp / name, dest)
        os.replace(tmp / "prepare_meta.json", out / "prepare_meta.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _split(rows: list, val_fraction: float) -> tuple[list, list]:
    """Val = the first share of the (already shuffled) rows; at least one of each when there are two or more."""
    n = len(rows)
    n_val = int(round(n * val_fraction))
    if val_fraction > 0 and n >= 2:
        n_val = min(max(n_val, 1), n - 1)
    return rows[n_val:], rows[:n_val]


def prepare(
    cfg: DataConfig,
    target_name: Any,
    *,
    tokenizer: Any = None,
    model: torch.nn.Module | None = None,
    collect: CollectConfig | None = None,
) -> dict[str, Any]:
    """Prepare training data for a target; returns the summary (also written to ``prepare_meta.json``).

    ``target_name`` is a target name (or a ``TargetConfig``); ``tokenizer`` / ``model`` may be given to skip
    loading (the model is only used with ``cfg.regenerate``). An output with the same settings is kept as is
    (the summary then has ``skipped: true``). ``collect`` names the features that ``cfg.capture_features``
    keeps (its aux layers and storage dtype; default: the collect defaults).
    """
    cfg.validate()
    for spec in cfg.sources:  # fail on a bad source before any model is loaded
        parsed = parse_source_spec(spec)
        if parsed.needs_regeneration and not cfg.regenerate:
            load_source(spec, regenerate=False)  # raises the explanatory error
    started = time.time()
    deadline = Deadline(cfg.regen_max_minutes)  # counts model loading too: the limit is for prepare as a whole
    unanswered = 0
    name = _target_name(target_name)
    loads_model = model is None
    tokenizer, model = _load_models(cfg, target_name, tokenizer, model)
    _check_template(tokenizer)
    model_fp = _model_fingerprint(model) if cfg.regenerate else None
    config_hash = _config_hash(cfg, name, tokenizer, model_fp)
    out = Path(cfg.output_dir)
    meta_path = out / "prepare_meta.json"
    if meta_path.is_file() and (out / "train").is_dir() and (out / "val").is_dir():
        try:
            old = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            old = {}
        was_cut = bool((old.get("dropped") or {}).get("regen_time_limit"))
        if old.get("config_hash") == config_hash and not (was_cut and cfg.regen_max_minutes is None):
            log.info("prepare: %s is up to date (same settings); skipping", out)
            return {**old, "skipped": True}
        if old.get("config_hash") == config_hash:
            log.info("prepare: %s was cut by a time limit; answering the rest (no limit now)", out)

    conversations, stats = _select(cfg)
    captured = None
    if cfg.regenerate:
        regen_key = _regen_key(cfg, name, tokenizer, model_fp)
        partial = out / f"regen-{regen_key}.jsonl"
        out.mkdir(parents=True, exist_ok=True)
        if cfg.regen_engine == "vllm":
            return_dtype = str(_model_dtype(model)).removeprefix("torch.")
            if cfg.capture_features:
                log.warning("data.capture_features: vLLM keeps no hidden states; `eagle collect` computes them")
            del model  # vLLM loads the target itself, in its worker process
            engine_target = (resolve_target(name), return_dtype)
            selected = len(conversations)
            conversations = regenerate(conversations, tokenizer, None, cfg, partial, deadline,
                                       engine_target=engine_target)
            unanswered = selected - len(conversations)
            model = None
        converts = (model is not None and cfg.regen_dtype is not None
                    and _model_dtype(model) != getattr(torch, cfg.regen_dtype))
        capture = _capture_plan(cfg, collect, model, model_fp, out, regen_key) if model is not None else None
        if converts:
            if not loads_model:
                model = copy.deepcopy(model)  # the caller's model stays as it was
            model = model.to(getattr(torch, cfg.regen_dtype))
            loads_model = True
        if model is not None and loads_model and getattr(target_name, "cpu_prepack", True):
            from eagle.targets import prepack_for_cpu

            # our own copy, fingerprinted above: regeneration ~1.5x faster on a CPU (fp32), ~2x more in bf16
            prepack_for_cpu(model, dtypes=(torch.float32, torch.bfloat16))
        if model is not None:
            selected = len(conversations)
            conversations = regenerate(conversations, tokenizer, model, cfg, partial, deadline, capture)
            unanswered = selected - len(conversations)
        if capture is not None:
            captured = {"dir": capture[0].name, "spec": dataclasses.asdict(capture[1])}
    rows, dropped = _encode_all(conversations, tokenizer, cfg)
    if unanswered:
        dropped["regen_time_limit"] = unanswered
    for spec in cfg.sources:
        stats[spec]["kept"] = sum(r[0].source == spec for r in rows)
        if stats[spec]["selected"] and not stats[spec]["kept"]:
            raise EagleError(
                f"data source {spec!r} has no assistant turns to train on after filtering ({dict(dropped)} of "
                f"{stats[spec]['selected']} conversations); give data with answers, set data.regenerate=true, "
                "or raise data.max_length"
            )
    if not rows:
        raise EagleError(
            f"no conversation with assistant turns is left ({dict(dropped)}); check data.sources "
            "or set data.regenerate=true"
        )
    train, val = _split(rows, cfg.val_fraction)
    splits = {"train": train, "val": val}
    truncated = dropped.pop("truncated", 0)
    meta = {
        "format": FORMAT_VERSION,
        "config_hash": config_hash,
        "target": name,
        "target_fingerprint": model_fp,
        "tokenizer": _tokenizer_identity(tokenizer),
        "config": dataclasses.asdict(cfg),
        "sources": stats,
        "max_length": cfg.max_length,
        "on_overlong": cfg.on_overlong,
        "regenerate": cfg.regenerate,
        "regen": {k: v for k, v in dataclasses.asdict(cfg).items() if k.startswith("regen_")}
        if cfg.regenerate
        else None,
        "captured_features": captured,
        "counts": {k: len(v) for k, v in splits.items()},
        "dropped": dict(dropped),
        "truncated": truncated,
        "tokens": {k: sum(len(r[1]) for r in v) for k, v in splits.items()},
        "assistant_tokens": {k: sum(sum(r[2]) for r in v) for k, v in splits.items()},
        "seconds": round(time.time() - started, 1),
    }
    _save_atomic(out, splits, meta)
    log.info("prepare: wrote %s (%s)", out, meta["counts"])
    return {**meta, "skipped": False}
