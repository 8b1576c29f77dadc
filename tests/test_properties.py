"""Property-based tests (hypothesis): data preparation (loss masks, truncation) and draft trees (masks, positions,
retrieval paths, verification along them) stay consistent for any input, not just the hand-picked examples.

The loss-mask property computes the expected mask independently: the conversations are rendered with a plain
ChatML template whose layout is known here, so every character of every message has a known role.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from eagle.errors import EagleError
from eagle.tree import (
    TreeConfig,
    build_chain,
    build_dynamic_tree,
    build_static_tree,
    tree_from_parents,
)
from eagle.verify import verify_greedy
from train.chat_template import tokenize_conversation
from train.prepare import DataConfig, _encode_all
from train.sources import Conversation

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# every message is "<|im_start|>{role}\n{content}<|im_end|>\n", content verbatim
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@functools.cache
def chatml_tokenizer():
    """The SmolLM2 tokenizer (<|im_start|> / <|im_end|> are special tokens) with the plain template above."""
    from eagle.targets import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    tokenizer.chat_template = CHATML
    return tokenizer


# ------------------------------------------------------------------------------------------- conversations

# any text except what would read as a special token; letters, digits, spaces, newlines, accents, CJK, emoji
TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from(list("abcdefghij XYZ 0123456789 .,;:!?'\"\n\t-_()[]{}#=+*/\\")),
        st.characters(min_codepoint=0xA0, max_codepoint=0x2FFF, blacklist_categories=("Cs", "Cc")),
        st.sampled_from(list("中文é🙂ß")),
    ),
    max_size=40,
).filter(lambda s: "<|" not in s)


@st.composite
def conversations(draw, first_role: str | None = None) -> list[dict[str, str]]:
    """Optional system prompt, then 1-4 user/assistant exchanges (the last answer may be missing)."""
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(TEXT)})
    for _ in range(draw(st.integers(1, 4))):
        messages.append({"role": "user", "content": draw(TEXT)})
        messages.append({"role": "assistant", "content": draw(TEXT)})
    if draw(st.booleans()) and len(messages) > 2:
        messages.pop()  # ends with a prompt
    if first_role == "assistant":
        messages = [m for m in messages if m["role"] != "system"]
        messages.insert(0, {"role": "assistant", "content": draw(TEXT)})
    return messages


def expected_mask(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(ids, mask) from first principles: a token is trained on iff it overlaps an assistant message's content,
    or it is the <|im_end|> that closes an assistant message."""
    text, spans, closers = "", [], set()
    for m in messages:
        text += f"<|im_start|>{m['role']}\n"
        start = len(text)
        text += m["content"]
        if m["role"] == "assistant":
            spans.append((start, len(text)))
            closers.add(len(text))
        text += "<|im_end|>\n"
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    mask = []
    for tok, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]):
        inside = any(a < e and b > s for s, e in spans if e > s)
        closes = tok == end_id and a in closers
        mask.append(int(inside or closes))
    return list(enc["input_ids"]), mask


@SETTINGS
@given(conversations())
def test_loss_mask_is_exactly_the_assistant_content_and_its_end_of_turn(messages):
    tokenizer = chatml_tokenizer()
    ids, mask = tokenize_conversation(tokenizer, messages)
    want_ids, want_mask = expected_mask(tokenizer, messages)
    assert ids == want_ids
    assert mask == want_mask
    # one masked run per assistant turn (each has at least its <|im_end|>), nothing from other roles
    runs = sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
    assert runs == sum(m["role"] == "assistant" for m in messages)


@SETTINGS
@given(conversations(first_role="assistant"))
def test_loss_mask_when_the_conversation_opens_with_an_answer(messages):
    tokenizer = chatml_tokenizer()
    ids, mask = tokenize_conversation(tokenizer, messages)
    assert (ids, mask) == expected_mask(tokenizer, messages)


@SETTINGS
@given(
    st.lists(conversations(), min_size=1, max_size=6),
    st.integers(8, 80),
    st.sampled_from(["truncate", "skip", "error"]),
)
def test_max_length_truncates_skips_or_refuses_consistently(all_messages, max_length, policy):
    tokenizer = chatml_tokenizer()
    convs = [Conversation(f"c{i}", m, "prop") for i, m in enumerate(all_messages)]
    full = {c.id: tokenize_conversation(tokenizer, c.messages) for c in convs}
    trainable = [c.id for c in convs if any(full[c.id][1])]
    overlong = [cid for cid in trainable if len(full[cid][0]) > max_length]
    cfg = DataConfig(max_length=max_length, on_overlong=policy).validate()
    if policy == "error" and overlong:
        with pytest.raises(EagleError, match=rf"{overlong[0]} .* > data\.max_length={max_length}"):
            _encode_all(convs, tokenizer, cfg)
        return
    rows, counts = _encode_all(convs, tokenizer, cfg)
    for conv, ids, mask in rows:
        assert len(ids) == len(mask) <= max_length and set(mask) <= {0, 1} and any(mask)
        assert ids == full[conv.id][0][:max_length] and mask == full[conv.id][1][:max_length]  # a prefix
    kept = [conv.id for conv, _, _ in rows]
    if policy == "skip":
        assert kept == [cid for cid in trainable if cid not in overlong]
        assert counts["overlong_skipped"] == len(overlong)
    else:
        assert kept == [cid for cid in trainable if any(full[cid][1][:max_length])]
        assert counts["truncated"] == sum(cid in overlong for cid in kept)


# ----------------------------------------------------------------------------------------------------- trees


@st.composite
def parent_lists(draw, max_nodes: int = 24) -> list[int]:
    """Parents of a random tree in topological order (node 0 = root)."""
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


def ancestors(parents: list[int], node: int) -> set[int]:
    out = set()
    while node >= 0:
        out.add(node)
        node = parents[node]
    return out


def check_tree(tree, parents: list[int]) -> None:
    """Depths, ancestor mask, positions and retrieval paths agree with the parent list."""
    n = len(parents)
    assert tree.size == n and tree.parents.tolist() == parents
    depths = tree.depths.tolist()
    for i in range(1, n):
        assert depths[i] == depths[parents[i]] + 1
    want = torch.tensor([[j in ancestors(parents, i) for j in range(n)] for i in range(n)])
    assert torch.equal(tree.attn_mask, want)
    assert torch.equal(tree.attn_mask.sum(1), tree.depths + 1)  # a node sees exactly its depth+1 ancestors
    assert not torch.triu(tree.attn_mask, diagonal=1).any()  # ancestors come first
    leaves = {i for i in range(n) if i not in parents}
    assert tree.paths.shape == (len(leaves), max(depths) + 1)
    assert tree.max_depth == max(depths)
    seen, ends = set(), []
    for row in tree.paths.tolist():
        real = [x for x in row if x >= 0]
        assert row == real + [-1] * (len(row) - len(real))  # padding only at the end
        assert real[0] == 0 and len(real) == depths[real[-1]] + 1
        assert all(parents[b] == a for a, b in zip(real, real[1:]))  # each step goes to a child
        assert [depths[x] for x in real] == list(range(len(real)))  # position offsets along the path
        seen.update(real)
        ends.append(real[-1])
    assert sorted(ends) == sorted(leaves)  # one retrieval path per leaf
    assert seen == set(range(n))  # every node lies on some retrieval path
    for node in range(n):
        assert tree.children(node) == [i for i in range(n) if parents[i] == node]


@SETTINGS
@given(parent_lists(), st.integers(0, 1000))
def test_tree_from_parents_is_consistent(parents, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (len(parents),), generator=gen)
    tree = tree_from_parents(tokens, parents)
    check_tree(tree, parents)
    assert torch.equal(tree.tokens, tokens)


@SETTINGS
@given(st.lists(st.integers(-3, 30), min_size=1, max_size=8))
def test_malformed_parent_lists_are_refused(parents):
    valid = parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i > 0)
    if valid:
        check_tree(tree_from_parents(list(range(len(parents))), parents), parents)
    else:
        with pytest.raises(EagleError):
            tree_from_parents(list(range(len(parents))), parents)


class RandomDraft:
    """An ``expand`` callback with fixed random log-probs per (node path): distinct child tokens, sorted
    best-first, log-probs <= 0 (some -inf, as a draft vocabulary smaller than k gives)."""

    def __init__(self, seed: int, vocab: int = 40, with_inf: bool = False):
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab, self.with_inf = vocab, with_inf
        self.proposed: dict[tuple[int, int], float] = {}  # (parent node, token) -> log-prob
        self.score = {0: 0.0}  # cumulative log-prob of every candidate, by the builder's node numbering

    def __call__(self, nodes, k, tokens, parents):
        k_eff = min(k, self.vocab)
        out_tok = torch.zeros(len(nodes), k_eff, dtype=torch.long)
        out_lp = torch.zeros(len(nodes), k_eff)
        for r, node in enumerate(nodes):
            logits = torch.randn(self.vocab, generator=self.gen) * 3
            if self.with_inf:
                logits[torch.rand(self.vocab, generator=self.gen) < 0.5] = -math.inf
                logits[0] = 0.0  # at least one finite
            lp, tok = torch.log_softmax(logits, -1).topk(k_eff)
            out_tok[r], out_lp[r] = tok, lp
            for c, (t, v) in enumerate(zip(tok.tolist(), lp.tolist())):
                self.proposed[(node, t)] = v
                # builders append the children of nodes[r] in this order after the call
                self.score[len(tokens) + r * k_eff + c] = self.score[node] + v
        return out_tok, out_lp


@SETTINGS
@given(
    st.integers(1, 6),
    st.integers(1, 5),
    st.integers(2, 40),
    st.integers(0, 10_000),
    st.booleans(),
)
def test_dynamic_tree_keeps_the_best_candidates_and_stays_consistent(depth, top_k, total, seed, with_inf):
    draft = RandomDraft(seed, with_inf=with_inf)
    tree = build_dynamic_tree(7, draft, depth, top_k, total)
    parents = tree.parents.tolist()
    check_tree(tree, parents)
    tokens, lps = tree.tokens.tolist(), tree.draft_logprobs.tolist()
    candidates = (
        top_k + (depth - 1) * top_k * top_k
    )  # top_k children of the root, then of top_k nodes a level
    assert len(draft.score) == 1 + candidates
    assert tree.size == min(total, 1 + candidates) and tokens[0] == 7
    assert tree.max_depth <= depth
    score = [0.0] * tree.size
    for i in range(1, tree.size):
        assert lps[i] <= 0
        score[i] = score[parents[i]] + lps[i]
        assert score[i] <= score[parents[i]]  # a child never outranks its parent
    # EAGLE-2 reranking: the kept drafts are the best total-1 of all candidates by cumulative log-prob
    everything = sorted((v for node, v in draft.score.items() if node), reverse=True)
    assert sorted(score[1:], reverse=True) == everything[: tree.size - 1]
    for node in range(tree.size):  # siblings: distinct tokens, best first
        kids = tree.children(node)
        assert len({tokens[c] for c in kids}) == len(kids)
        assert all(score[a] >= score[b] for a, b in zip(kids, kids[1:]))


@SETTINGS
@given(st.integers(1, 8), st.integers(0, 10_000))
def test_chain_is_one_path(depth, seed):
    tree = build_chain(3, RandomDraft(seed), depth)
    check_tree(tree, [-1] + list(range(depth)))
    assert tree.paths.tolist() == [list(range(depth + 1))]


@st.composite
def static_paths(draw) -> list[list[int]]:
    """A prefix-closed set of child-rank paths (EAGLE-1 "choices")."""
    paths: list[tuple[int, ...]] = []
    frontier = [()]
    for _ in range(draw(st.integers(1, 12))):
        parent = draw(st.sampled_from(frontier))
        if len(parent) >= 4:
            continue
        rank = draw(st.integers(0, 3))
        path = (*parent, rank)
        if path not in paths:
            paths.append(path)
            frontier.append(path)
    return [list(p) for p in paths]


@SETTINGS
@given(static_paths(), st.integers(0, 10_000))
def test_static_tree_puts_each_path_at_its_rank(paths, seed):
    assume(paths)
    TreeConfig(policy="static", static_paths=paths).validate()
    draft = RandomDraft(seed)
    tree = build_static_tree(5, draft, paths)
    parents = tree.parents.tolist()
    check_tree(tree, parents)
    assert tree.size == len(paths) + 1
    for node in range(
        1, tree.size
    ):  # every node is a token its parent's expansion proposed, with that log-prob
        assert (parents[node], int(tree.tokens[node])) in draft.proposed
        assert tree.draft_logprobs[node].item() == pytest.approx(
            draft.proposed[(parents[node], int(tree.tokens[node]))]
        )


@SETTINGS
@given(parent_lists(max_nodes=16), st.integers(0, 10_000), st.integers(2, 6))
def test_greedy_verification_walks_a_retrieval_path(parents, seed, vocab):
    """The accepted nodes are a prefix of one retrieval path, each the target's argmax after its parent."""
    gen = torch.Generator().manual_seed(seed)
    n = len(parents)
    tokens = [0] * n
    for node in range(n):  # distinct sibling tokens, as every builder makes them
        kids = [i for i in range(n) if parents[i] == node]
        assume(len(kids) <= vocab)
        for token, kid in zip(torch.randperm(vocab, generator=gen).tolist(), kids):
            tokens[kid] = token
    tree = tree_from_parents(tokens, parents)
    logits = torch.randn(n, vocab, generator=gen)
    accepted, bonus = verify_greedy(tree, logits)
    path = accepted.tolist()
    assert path[0] == 0 and all(parents[b] == a for a, b in zip(path, path[1:]))
    assert all(tokens[b] == int(logits[a].argmax()) for a, b in zip(path, path[1:]))
    assert bonus == int(logits[path[-1]].argmax())
    assert not any(tokens[c] == bonus for c in tree.children(path[-1]))  # it stopped where nothing matched
    rows = [[x for x in row if x >= 0] for row in tree.paths.tolist()]
    assert any(row[: len(path)] == path for row in rows)
