"""Shared-prefix packing: the rows of a batch as one trie of their unique tokens.

Rows of a training batch come from trees: the leaves of one prompt share the prompt, the leaves of one tree
share the steps above their branch point, and all rows share the chat-template prefix. The trie has one node
per unique prefix: two (row, position) pairs map to the same node exactly when the rows agree on every token up
to and including that position. Forwarding the nodes once, each attending to itself and its ancestors (the tree
attention mask) at position id = its depth, gives every node the hidden state the per-row forward computes for
each row through it.

Nodes are numbered in depth-first preorder of the trie (rows sorted lexicographically, then each row's new
nodes in order), so a node's subtree is the contiguous range ``[node, subtree_end)``; the ancestor relation,
and with it the attention mask, follows from that one vector without walking the tree.

Pure numpy / torch, no model: :mod:`policies.logprobs` uses it for the packed forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

NO_NODE = -1  # node index of a padding position; parent of a root


@dataclass(frozen=True)
class PrefixTrie:
    """The trie of a batch's rows; U nodes in depth-first preorder, rows as given (B rows, T columns).

    token_ids [U]: each node's token. positions [U]: its depth (the position id of the token in its rows).
    parents [U]: the node of the previous token, ``NO_NODE`` for the roots. subtree_ends [U]: one past the last
    node of the node's subtree. node_index [B, T]: the node of each real (row, column), ``NO_NODE`` at padding.
    """

    token_ids: np.ndarray
    positions: np.ndarray
    parents: np.ndarray
    subtree_ends: np.ndarray
    node_index: np.ndarray

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens over all rows."""
        return int((self.node_index != NO_NODE).sum())


def compact_rows(input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's real tokens moved to the front, in order, ``NO_NODE`` after them (any padding side).

    Returns (tokens [B, L] with L the longest row, lengths [B], depth [B, T]: the index of each real column in
    its row's compacted tokens, the position id the per-row forward gives it).
    """
    real = attention_mask.astype(bool)
    lengths = real.sum(axis=1)
    depth = np.cumsum(real, axis=1) - 1
    tokens = np.full((len(real), int(lengths.max(initial=0))), NO_NODE, dtype=np.int64)
    rows, _ = np.nonzero(real)
    tokens[rows, depth[real]] = input_ids[real]
    return tokens, lengths, depth


def common_prefix_lengths(tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Length of the prefix each row shares with the row before it (0 for the first row). tokens [B, L] as from
    :func:`compact_rows`."""
    if tokens.size == 0:
        return np.zeros(len(tokens), dtype=np.int64)
    differs = tokens[1:] != tokens[:-1]
    first_difference = np.where(differs.any(axis=1), differs.argmax(axis=1), tokens.shape[1])
    shared = np.minimum(first_difference, np.minimum(lengths[1:], lengths[:-1]))
    return np.concatenate([[0], shared]).astype(np.int64)


def lexicographic_order(tokens: np.ndarray) -> np.ndarray:
    """Row order that sorts the rows lexicographically (a row before its extensions), so that rows sharing a
    prefix are adjacent."""
    if tokens.shape[1] == 0:
        return np.arange(len(tokens))
    return np.lexsort(tokens[:, ::-1].T)  # lexsort's last key is the primary one


def build_prefix_trie(input_ids: np.ndarray, attention_mask: np.ndarray) -> PrefixTrie:
    """The trie of the rows of ``input_ids`` [B, T] (real tokens where ``attention_mask`` is nonzero)."""
    input_ids, attention_mask = np.asarray(input_ids), np.asarray(attention_mask)
    tokens, lengths, depth = compact_rows(input_ids, attention_mask)
    order = lexicographic_order(tokens)
    tokens, lengths = tokens[order], lengths[order]
    n_rows, width = tokens.shape
    columns = np.arange(width)[None, :]
    real = columns < lengths[:, None]
    # A (sorted) row's nodes past the prefix it shares with the row before it are new; the shared ones belong
    # to the latest earlier row where they were new.
    is_new = real & (columns >= common_prefix_lengths(tokens, lengths)[:, None])
    new_id = np.cumsum(is_new.ravel()).reshape(is_new.shape) - 1
    owner = np.maximum.accumulate(np.where(is_new, np.arange(n_rows)[:, None], 0), axis=0)
    nodes = np.where(real, new_id[owner, columns], NO_NODE)

    parents = np.where(columns > 0, np.roll(nodes, 1, axis=1), NO_NODE)[is_new]
    # A node's subtree ends after the new nodes of the last row through it.
    is_last = real & np.vstack([nodes[1:] != nodes[:-1], np.ones((1, width), dtype=bool)])
    nodes_through_row = np.cumsum(is_new.sum(axis=1))
    subtree_ends = np.empty(int(is_new.sum()), dtype=np.int64)
    subtree_ends[nodes[is_last]] = np.broadcast_to(nodes_through_row[:, None], is_last.shape)[is_last]

    nodes_by_row = np.empty_like(nodes)
    nodes_by_row[order] = nodes
    real_columns = attention_mask.astype(bool)
    node_index = np.full(input_ids.shape, NO_NODE, dtype=np.int64)
    node_index[real_columns] = nodes_by_row[np.nonzero(real_columns)[0], depth[real_columns]]
    return PrefixTrie(
        token_ids=tokens[is_new], positions=np.broadcast_to(columns, is_new.shape)[is_new],
        parents=parents, subtree_ends=subtree_ends, node_index=node_index,
    )


# -- segments: the trie as the rows of one packed batch ---------------------------------------------------------
#
# Attention over one packed sequence of U nodes costs U^2 with a dense mask, while the rows cost sum_b T_b^2: a
# batch of several prompts packed whole can be slower than its rows. So the trie is cut into segments, each a
# subtree with its ancestor path (the ancestors, e.g. a shared system prefix, repeated in every segment below
# them), laid out as the rows of a batch; the cut minimises tokens + pair_cost * tokens^2 summed over segments.


@dataclass(frozen=True)
class SegmentLayout:
    """The trie's nodes as G segments of at most S nodes each (in preorder within a segment).

    node_ids [G, S]: the node in each slot, ``NO_NODE`` in padding slots. row_segments [B]: the segment that holds
    all of a row's nodes (the row's tokens are read from there). slots [G, U]: the slot of each node in each
    segment, ``NO_NODE`` where the segment does not hold it.
    """

    node_ids: np.ndarray
    row_segments: np.ndarray
    slots: np.ndarray

    @property
    def num_tokens(self) -> int:
        """Nodes over all segments (an ancestor counts once per segment that holds it)."""
        return int((self.node_ids != NO_NODE).sum())


def segment_cost(tokens: np.ndarray | int, pair_cost: float) -> np.ndarray | float:
    """The cost model of a segment of ``tokens`` nodes: per-token work plus ``pair_cost`` per attention pair."""
    tokens = np.asarray(tokens, dtype=np.float64)
    return tokens + pair_cost * tokens**2


def choose_cuts(trie: PrefixTrie, pair_cost: float) -> np.ndarray:
    """The segments' top nodes, sorted: ``[NO_NODE]`` for one segment of the whole trie, else nodes whose
    subtrees are disjoint and hold every leaf. Optimal under :func:`segment_cost` among cuts at branch points.

    Only leaves and branching nodes are candidates: down a chain of only children the segment below a node
    holds the same nodes (its ancestors grow as its subtree shrinks), and in preorder the chain is contiguous.
    """
    n_nodes = trie.num_nodes
    if n_nodes == 0:
        return np.array([NO_NODE])
    nodes = np.arange(n_nodes)
    cost = segment_cost(trie.positions + trie.subtree_ends - nodes, pair_cost)
    n_children = np.bincount(trie.parents[trie.parents != NO_NODE], minlength=n_nodes)
    candidate = n_children != 1
    chain_end = np.minimum.accumulate(np.where(candidate, nodes, n_nodes)[::-1])[::-1]  # next candidate node
    children: dict[int, list[int]] = {}
    for child in np.nonzero(trie.parents != NO_NODE)[0]:
        if n_children[trie.parents[child]] > 1:
            children.setdefault(int(trie.parents[child]), []).append(int(chain_end[child]))
    best, split = {}, {}
    for node in np.nonzero(candidate)[0][::-1]:  # reverse preorder: descendants first
        node = int(node)
        split[node] = sum(best[c] for c in children[node]) if node in children else np.inf
        best[node] = min(cost[node], split[node])
    roots = [int(chain_end[r]) for r in np.nonzero(trie.parents == NO_NODE)[0]]
    if segment_cost(n_nodes, pair_cost) <= sum(best[r] for r in roots):
        return np.array([NO_NODE])
    cuts, pending = [], roots
    while pending:
        node = pending.pop()
        if cost[node] <= split[node]:
            cuts.append(node)
        else:
            pending += children[node]
    return np.sort(np.array(cuts, dtype=np.int64))


def last_nodes(trie: PrefixTrie) -> np.ndarray:
    """The node of each row's last real token, ``NO_NODE`` for an empty row."""
    real = trie.node_index != NO_NODE
    last_column = real.shape[1] - 1 - np.argmax(real[:, ::-1], axis=1)
    return np.where(real.any(axis=1), trie.node_index[np.arange(len(real)), last_column], NO_NODE)


def segment_nodes(trie: PrefixTrie, cut: int) -> np.ndarray:
    """The nodes of the segment below ``cut``, in preorder: its ancestors and its subtree (all for NO_NODE)."""
    nodes = np.arange(trie.num_nodes)
    if cut == NO_NODE:
        return nodes
    return nodes[((nodes < cut) & (trie.subtree_ends > cut)) | ((nodes >= cut) & (nodes < trie.subtree_ends[cut]))]


def layout_segments(trie: PrefixTrie, cuts: np.ndarray) -> SegmentLayout:
    """The segments below ``cuts`` (from :func:`choose_cuts`) as a padded layout, and each row's segment."""
    members = [segment_nodes(trie, int(cut)) for cut in cuts]
    node_ids = np.full((len(cuts), max(map(len, members))), NO_NODE, dtype=np.int64)
    slots = np.full((len(cuts), trie.num_nodes), NO_NODE, dtype=np.int64)
    for segment, nodes in enumerate(members):
        node_ids[segment, :len(nodes)] = nodes
        slots[segment, nodes] = np.arange(len(nodes))
    ends = last_nodes(trie)
    if cuts[0] == NO_NODE:
        row_segments = np.zeros(len(ends), dtype=np.int64)
    else:
        # The last cut at or before a row's end holds it when the end lies in its subtree; otherwise the end is
        # an ancestor of the next cut (a row that stops at a branch point).
        before = np.searchsorted(cuts, ends, side="right") - 1
        inside = (before >= 0) & (ends < trie.subtree_ends[cuts[before.clip(min=0)]])
        row_segments = np.where(inside | (ends == NO_NODE), before.clip(min=0), before + 1)
    return SegmentLayout(node_ids=node_ids, row_segments=row_segments, slots=slots)


@dataclass(frozen=True)
class ScoredPredictions:
    """The predictions of scored tokens, once per unique (predicting node, target) pair, i.e. per unique node.

    slots [S]: the flat slot (segment * width + slot) whose hidden state predicts the node. targets [S]: the
    node's token. inverse [N]: the unique prediction of each scored (row, column).
    """

    slots: np.ndarray
    targets: np.ndarray
    inverse: np.ndarray


def scored_predictions(trie: PrefixTrie, layout: SegmentLayout, rows: np.ndarray, columns: np.ndarray
                       ) -> ScoredPredictions:
    """The unique predictions behind the scored tokens (rows[i], columns[i]) (each a real token after a real
    token): a node shared by several rows is predicted once, from the hidden state of its parent in the
    segment of the first row that scores it."""
    nodes, first, inverse = np.unique(trie.node_index[rows, columns], return_index=True, return_inverse=True)
    segments = layout.row_segments[rows[first]]
    slots = segments * layout.node_ids.shape[1] + layout.slots[segments, trie.parents[nodes]]
    return ScoredPredictions(slots=slots, targets=trie.token_ids[nodes], inverse=inverse.reshape(-1))


def segment_subtree_ends(trie: PrefixTrie, layout: SegmentLayout) -> np.ndarray:
    """[G, S]: one past the last slot of each slot's subtree within its segment (a padding slot: itself alone).

    A segment keeps preorder, so the nodes of a subtree that it holds are the contiguous slots from the subtree's
    top on: those whose node is below ``subtree_ends[top]``. The tree attention mask in slot terms is then
    :func:`on_path` of this one vector, which a block-sparse kernel evaluates per block.
    """
    n_segments, width = layout.node_ids.shape
    real = layout.node_ids != NO_NODE
    stride = trie.num_nodes + 1  # offsets that keep the flattened rows sorted one after another
    offsets = np.arange(n_segments)[:, None] * stride
    sorted_nodes = np.where(real, layout.node_ids, trie.num_nodes) + offsets
    if trie.num_nodes:
        ends_of_nodes = trie.subtree_ends[np.where(real, layout.node_ids, 0)]
    else:
        ends_of_nodes = np.zeros(layout.node_ids.shape, dtype=np.int64)
    slot_ends = np.searchsorted(sorted_nodes.ravel(), (ends_of_nodes + offsets).ravel()).reshape(real.shape)
    slot_ends -= np.arange(n_segments)[:, None] * width
    return np.where(real, slot_ends, np.arange(width)[None, :] + 1)


def on_path(query: torch.Tensor, key: torch.Tensor, key_end: torch.Tensor) -> torch.Tensor:
    """Whether the key slot lies on the query slot's path (it is the query or an ancestor of it), for slots in
    preorder: the query lies in the key's subtree ``[key, key_end)``. Broadcasts; also a flex_attention
    ``mask_mod`` body."""
    return (key <= query) & (query < key_end)


def tree_attention_mask(slot_ends: torch.Tensor) -> torch.Tensor:
    """Boolean [..., S, S] from ``slot_ends`` [..., S] (:func:`segment_subtree_ends`): slot i may attend to
    slot j iff j is on i's path. A padding slot attends to itself alone (no query row is empty)."""
    slots = torch.arange(slot_ends.shape[-1], device=slot_ends.device)
    return on_path(slots[:, None], slots[None, :], slot_ends[..., None, :])


def tree_block_mask(slot_ends: torch.Tensor) -> BlockMask:
    """flex_attention's block mask of :func:`tree_attention_mask` for slot_ends [G, S]: the same ``on_path``
    test, evaluated once here to find the 128 x 128 blocks that hold no visible pair, which the kernel then skips
    (0.44-0.56 of a tree batch's blocks hold any). Built once per batch; it keeps ``slot_ends`` for the partly
    visible blocks."""
    n_segments, width = slot_ends.shape

    def visible(segment, head, query, key):
        return on_path(query, key, slot_ends[segment, key])

    return create_block_mask(visible, B=n_segments, H=None, Q_LEN=width, KV_LEN=width, device=slot_ends.device)
