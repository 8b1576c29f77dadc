"""Drafters: what proposes the draft tree between two target verifications.

A drafter follows the committed sequence x_0 .. x_{n-1} (verified, target features known) and the root x_n (the
token the target sampled last, not yet verified). The speculative loop calls:

* ``prefill(input_ids, hidden_states, next_token)`` once, with the prompt, the target's hidden states of every
  prompt position (the tuple HF returns with ``output_hidden_states=True``) and the first sampled token;
* ``draft(root_token, tree_cfg) -> DraftTree`` before a verification (not on a step whose prompt-lookup branch is
  verified alone, ``TreeConfig.lookup_alone``: ``accept`` must not depend on it);
* ``accept(accepted, hidden_states, next_tokens)`` after it: ``accepted`` are the tree nodes the target kept
  (root first), ``hidden_states`` the verification forward's hidden states over ALL tree nodes, ``next_tokens``
  the token that follows each accepted node (the accepted children, then the new root).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from eagle.devices import model_device
from eagle.errors import EagleError
from eagle.heads import HeadCache
from eagle.targets import cpu_has_fast_bf16, parse_dtype
from eagle.tree import DraftTree, TreeConfig, build_tree, tree_from_parents


@runtime_checkable
class Drafter(Protocol):
    """The interface the speculative loop drives (see the module docstring)."""

    def prefill(
        self, input_ids: torch.Tensor, hidden_states: tuple[torch.Tensor, ...], next_token: int
    ) -> None:
        """Start following a new sequence: the prompt [1, T], its target hidden states and the first token."""

    def draft(self, root_token: int, tree_cfg: TreeConfig) -> DraftTree:
        """Propose a tree rooted at ``root_token`` (the last sampled token)."""

    def accept(
        self, accepted: torch.Tensor, hidden_states: tuple[torch.Tensor, ...], next_tokens: torch.Tensor
    ) -> None:
        """Commit the accepted nodes of the last tree (see the module docstring)."""


# positions per piece of the head's prefill: one fixed shape for every prompt (see HeadDrafter.prefill)
PREFILL_CHUNK = 128


def resolve_draft_dtype(
    setting: str | None, device: torch.device | str, target_dtype: torch.dtype
) -> torch.dtype:
    """The dtype a draft head computes in (``eval.draft_dtype``): ``"auto"``, None (the target's), or a name.

    The head only proposes tokens and the target verifies them, so its dtype changes the acceptance, never the
    output. ``"auto"`` picks bfloat16 on a CPU with native bf16 instructions: drafting there is ~1.6x faster than
    in fp32 with the same acceptance (the head is trained and exported in bf16),
    and the target's dtype everywhere else.
    """
    if setting is None:
        return target_dtype
    if setting == "auto":
        on_cpu = torch.device(device).type == "cpu"
        fast = on_cpu and target_dtype == torch.float32 and cpu_has_fast_bf16()
        return torch.bfloat16 if fast else target_dtype
    try:
        return parse_dtype(setting)
    except EagleError:
        raise EagleError(
            f"eval.draft_dtype {setting!r} is not supported; use auto, null (the target's dtype), float32, "
            "bfloat16 or float16"
        ) from None


def _topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, log-probs) of the k most likely tokens of each row of logits [n, V]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
    return ids, values


class HeadDrafter:
    """Drafts with a trained (or untrained) EAGLE head that keeps its own KV cache.

    Head alignment (ARCHITECTURE.md): the head entry at position i takes the target feature of x_i and the
    embedding of x_{i+1}; its output predicts the feature at i + 1, hence x_{i+2}. So after the committed
    sequence the head cache holds n entries (positions 0..n-1, the last one paired with the root), and the
    output of the last entry gives the root's children. A drafted node at depth d >= 1 is run with the
    output of its parent's entry as its hidden input, at position n - 1 + d, attending to the whole head cache
    prefix and to its own ancestors among the tree entries.
    """

    def __init__(self, head: torch.nn.Module, aux_layers: list[int] | None = None):
        cfg = head.config
        self.head = head
        self.kind = cfg.kind
        self.aux_layers = list(aux_layers if aux_layers is not None else cfg.aux_layers)
        if self.kind == "eagle3" and not self.aux_layers:
            raise EagleError("an eagle3 head needs aux_layers: pass HeadDrafter(head, aux_layers=[...])")
        self.cache = HeadCache()
        self.last_out: torch.Tensor | None = None  # [1, 1, h]: output of the last committed entry
        self.prefill_chunk = PREFILL_CHUNK
        # accepted entries not run through the head yet: (target features [1, m, k*h], next tokens [m]) per step
        self.queued: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def device(self) -> torch.device:
        return next(self.head.parameters()).device

    def _features(
        self, hidden_states: tuple[torch.Tensor, ...], index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The head's projected input [1, T, h] from the target's hidden states (optionally at positions index)."""
        return self.head.project(self._target_features(hidden_states, index))

    def _target_features(
        self, hidden_states: tuple[torch.Tensor, ...], index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The target layers the head reads, concatenated [1, T, k*h] (optionally at positions index)."""
        if self.kind == "eagle3":
            if max(self.aux_layers) >= len(hidden_states):
                raise EagleError(
                    f"aux layer {max(self.aux_layers)} is out of range for a target with "
                    f"{len(hidden_states) - 1} layers: use a head trained for this target"
                )
            parts = [hidden_states[i] for i in self.aux_layers]
        else:
            parts = [hidden_states[-1]]
        if index is not None:
            parts = [p[:, index.to(p.device)] for p in parts]
        return torch.cat([p.to(self.device) for p in parts], dim=-1)

    def _append_mask(self, m: int) -> torch.Tensor:
        """Mask [1, 1, m, n + m] for m new entries after the n in the cache: all of those, causal among the new."""
        n = self.cache.length
        mask = torch.ones(1, 1, m, n + m, dtype=torch.bool, device=self.device)
        mask[0, 0, :, n:] = torch.ones(m, m, dtype=torch.bool, device=self.device).tril()
        return mask

    def _run(
        self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None
    ):
        return self.head(ids[None].to(self.device), hidden, positions[None].to(self.device), mask, self.cache)

    @torch.no_grad()
    def prefill(
        self, input_ids: torch.Tensor, hidden_states: tuple[torch.Tensor, ...], next_token: int
    ) -> None:
        """Run the head over the prompt: entry i pairs feature i with token i + 1 (the last one with next_token).

        The prompt goes through in pieces of ``prefill_chunk`` positions, the last one padded at its end (causal
        attention: no real entry sees the padding, which is cropped from the cache after). Every prefill then
        has the same matrix shapes whatever the prompt's length: oneDNN's bf16 kernels are compiled and kept per
        shape (~0.5 MB each, never freed), so a bf16 head fed prompts of many lengths grew without bound.
        """
        ids = input_ids[0].to(self.device)
        n, chunk = ids.numel(), self.prefill_chunk
        pad = -n % chunk
        shifted = torch.cat([ids[1:], torch.tensor([int(next_token)], device=self.device)])
        shifted = torch.nn.functional.pad(shifted, (0, pad))
        feats = torch.nn.functional.pad(self._target_features(hidden_states), (0, 0, 0, pad))
        self.cache = HeadCache()
        self.queued = []
        for start in range(0, n + pad, chunk):
            piece = slice(start, start + chunk)
            positions = torch.arange(start, start + chunk, device=self.device)
            out = self._run(shifted[piece], self.head.project(feats[:, piece]), positions, self._append_mask(chunk))
        self.cache.crop(n)
        last = (n - 1) % chunk  # the prompt's last entry, in the last piece
        self.last_out = out[:, last : last + 1]

    @torch.no_grad()
    def accept(
        self, accepted: torch.Tensor, hidden_states: tuple[torch.Tensor, ...], next_tokens: torch.Tensor
    ) -> None:
        """Queue one head entry per accepted node: its real target feature with the embedding of the next token.
        The queue runs through the head when it next drafts (:meth:`catch_up`): steps verified without a draft
        (``TreeConfig.lookup_alone``) then cost no head forward of their own."""
        self.queued.append((self._target_features(hidden_states, accepted), next_tokens.to(self.device)))

    @torch.no_grad()
    def catch_up(self) -> None:
        """Run the queued entries through the head, every step since the last draft in one forward; the head's
        cache then holds the committed sequence."""
        if not self.queued:
            return
        features = torch.cat([f for f, _ in self.queued], dim=1)
        tokens = torch.cat([t for _, t in self.queued])
        self.queued = []
        n, m = self.cache.length, tokens.numel()
        positions = torch.arange(n, n + m, device=self.device)
        out = self._run(tokens, self.head.project(features), positions, self._append_mask(m))
        self.last_out = out[:, -1:]

    @torch.no_grad()
    def draft(self, root_token: int, tree_cfg: TreeConfig) -> DraftTree:
        """Grow a tree from the last committed output; the head cache is back at its committed length after."""
        self.catch_up()
        if self.last_out is None:
            raise EagleError("HeadDrafter.draft called before prefill: call prefill with the prompt first")
        n = self.cache.length
        # per candidate node: its head entry (index among this draft's entries) and its head output [h];
        # per entry: the entry of its parent node (-1 when the parent is the root)
        entry: dict[int, int] = {}
        out_of: dict[int, torch.Tensor] = {0: self.last_out[0, 0]}
        entry_parents: list[int] = []
        depth_of: dict[int, int] = {0: 0}

        def expand(nodes: list[int], k: int, tokens: list[int], parents: list[int]):
            for node in nodes:
                if node not in depth_of:
                    depth_of[node] = depth_of[parents[node]] + 1
            todo = [v for v in nodes if v not in out_of]
            if todo:
                self._run_nodes(todo, tokens, parents, entry, out_of, entry_parents, depth_of, n)
            logits = self.head.logits(torch.stack([out_of[v] for v in nodes])[None])[0]
            ids, logp = _topk_logprobs(logits, k)
            return self.head.draft_to_target(ids).cpu(), logp.cpu()

        try:
            tree = build_tree(root_token, expand, tree_cfg)
        finally:
            self.cache.crop(n)
        return tree

    def _run_nodes(self, todo, tokens, parents, entry, out_of, entry_parents, depth_of, n) -> None:
        """One head forward over the tree nodes ``todo`` (all children of already-run nodes)."""
        first = len(entry_parents)
        for v in todo:
            entry[v] = len(entry_parents)
            entry_parents.append(entry.get(parents[v], -1))
        total = len(entry_parents)
        # ancestor-or-self mask among this draft's entries
        anc = torch.zeros(total, total, dtype=torch.bool)
        for e, pe in enumerate(entry_parents):
            if pe >= 0:
                anc[e] = anc[pe]
            anc[e, e] = True
        mask = torch.ones(1, 1, len(todo), n + total, dtype=torch.bool)
        mask[0, 0, :, n:] = anc[first:]
        ids = torch.tensor([tokens[v] for v in todo])
        hidden = torch.stack([out_of[parents[v]] for v in todo])[None]
        positions = torch.tensor([n - 1 + depth_of[v] for v in todo])
        out = self._run(ids, hidden, positions, mask.to(self.device))
        for i, v in enumerate(todo):
            out_of[v] = out[0, i]


class OracleDrafter:
    """Drafts with the target itself (tests and upper bounds): children are the target's own top-k.

    The target's argmax child is scored as certain (log-prob 0, the others keep their log-probs), so EAGLE-2
    reranking always expands and keeps the greedy chain: at temperature 0 every tree whose budget allows a
    depth-``depth`` chain is fully accepted along it (tau == depth + 1). Each expansion recomputes the full
    sequence without a cache; use it only with small models.
    """

    def __init__(self, target_model: torch.nn.Module):
        self.model = target_model
        self.committed: list[int] = []
        self.last_root: int | None = None  # the root of the next tree: committed with its accepted drafts

    @torch.no_grad()
    def prefill(
        self, input_ids: torch.Tensor, hidden_states: tuple[torch.Tensor, ...], next_token: int
    ) -> None:
        """Remember the prompt (the oracle needs no features)."""
        self.committed = [int(t) for t in input_ids[0].tolist()]
        self.last_root = int(next_token)

    @torch.no_grad()
    def draft(self, root_token: int, tree_cfg: TreeConfig) -> DraftTree:
        """Build the tree from the target's own next-token distributions."""
        device = model_device(self.model)

        def expand(nodes: list[int], k: int, tokens: list[int], parents: list[int]):
            ids_out, logp_out = [], []
            for node in nodes:
                path = []
                while node >= 0:
                    path.append(tokens[node])
                    node = parents[node]
                seq = torch.tensor([self.committed + path[::-1]], device=device)
                logits = self.model(seq).logits[0, -1:]
                ids, logp = _topk_logprobs(logits, k)
                logp[:, 0] = 0.0  # the oracle is certain of its argmax (see the class docstring)
                ids_out.append(ids[0])
                logp_out.append(logp[0])
            return torch.stack(ids_out).cpu(), torch.stack(logp_out).cpu()

        return build_tree(root_token, expand, tree_cfg)

    def accept(
        self, accepted: torch.Tensor, hidden_states: tuple[torch.Tensor, ...], next_tokens: torch.Tensor
    ) -> None:
        """Commit the root and the accepted drafts (``next_tokens`` without its last, the target's own token: the
        verified tree may hold nodes this drafter did not make, such as a grafted lookup branch)."""
        if self.last_root is None:
            raise EagleError("OracleDrafter.accept called before prefill")
        self.committed += [self.last_root] + next_tokens.tolist()[:-1]
        self.last_root = int(next_tokens[-1])


class LookupDrafter:
    """Drafts nothing itself: every tree is its root alone, to which the loop grafts the prompt-lookup branch
    (``TreeConfig.lookup_ngram``). Prompt lookup decoding inside eagle's loop, for the targets transformers' own
    prompt lookup refuses (those with a recurrent state)."""

    def prefill(self, input_ids: torch.Tensor, hidden_states: tuple[torch.Tensor, ...], next_token: int) -> None:
        """Nothing to remember: the loop keeps the history the lookup reads."""

    def draft(self, root_token: int, tree_cfg: TreeConfig) -> DraftTree:
        """The root alone."""
        return tree_from_parents([int(root_token)], [-1])

    def accept(
        self, accepted: torch.Tensor, hidden_states: tuple[torch.Tensor, ...], next_tokens: torch.Tensor
    ) -> None:
        """Nothing to commit."""
