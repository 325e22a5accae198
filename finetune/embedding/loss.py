"""Sentence embeddings from an encoder's token states, and the contrastive loss that trains them.

`pool` reads the token states as sentence-transformers' Pooling module does: `mean` over the real
tokens, `cls` (the first token) or `last` (the last real token, right padding), optionally
L2-normalised (its Normalize module); `pool_packed` the same for texts packed several to a row.

`ContrastiveLoss` is sentence-transformers' MultipleNegativesRankingLoss (InfoNCE with in-batch
negatives), written against its 6.x source:

- each anchor a_i is scored against every candidate of the batch: the positives p_1..p_B, then each
  column of hard negatives n^1..n^k (candidates ordered [p; n^1; ...; n^k]), by cosine similarity
  times `scale`; the loss is the cross-entropy of a_i's own positive, averaged over anchors
  (its default directions ("query_to_doc",), partition "joint");
- `symmetric`: also each positive p_i against every anchor, the two cross-entropies' normalisers
  averaged (directions ("query_to_doc", "doc_to_query"), partition "per_direction": the
  symmetric InfoNCE of Günther et al. 2024);
- `matryoshka_dims`: sentence-transformers' MatryoshkaLoss around it, the loss summed (with
  `matryoshka_weights`, default 1) over the embeddings cut to each of these leading dimensions
  and L2-normalised;
- with a data-parallel `group` of several ranks, every rank's anchors and candidates are gathered
  with their gradients (pretrain/distributed/device.all_gather_with_grad): each rank's anchors see
  the global batch's candidates, and DP2 with the DP gradient averaging equals one process given
  the whole global batch (sentence-transformers' gather_across_devices).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pretrain.distributed.device import all_gather_with_grad

POOLING_MODES = ("mean", "cls", "last")


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str, normalize: bool = False) -> torch.Tensor:
    """[batch, hidden] sentence embeddings from token states [batch, seq, hidden] and the mask
    [batch, seq] (1 on real tokens, right padding)."""
    if mode == "cls":
        pooled = hidden[:, 0]
    elif mode == "mean":
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    elif mode == "last":
        last = attention_mask.long().sum(1).clamp(min=1) - 1
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    else:
        raise ValueError(f"pooling {mode!r} is not one of {', '.join(POOLING_MODES)}")
    return F.normalize(pooled, p=2, dim=-1) if normalize else pooled


def pool_packed(hidden: torch.Tensor, sample_ids: torch.Tensor, cls_positions: torch.Tensor, mode: str,
                normalize: bool = False) -> torch.Tensor:
    """`pool` for packed rows (pretrain/data/samples/packing.py's layout): [texts, hidden] from token
    states [rows, seq, hidden], each token's text number + 1 in `sample_ids` (0: padding) and each
    text's first token at the flat index `cls_positions` [texts]."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    ids = sample_ids.reshape(-1)
    texts = cls_positions.shape[0]
    if mode == "cls":
        pooled = flat[cls_positions]
    elif mode in ("mean", "last"):
        lengths = torch.bincount(ids, minlength=texts + 1)[1:]
        if mode == "last":
            pooled = flat[cls_positions + lengths - 1]
        else:
            sums = flat.new_zeros((texts + 1, flat.shape[-1])).index_add(0, ids, flat)[1:]
            pooled = sums / lengths.clamp(min=1).unsqueeze(-1).to(flat.dtype)
    else:
        raise ValueError(f"pooling {mode!r} is not one of {', '.join(POOLING_MODES)}")
    return F.normalize(pooled, p=2, dim=-1) if normalize else pooled


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sentence-transformers' cos_sim: [len(a), len(b)]."""
    return F.normalize(a, p=2, dim=1) @ F.normalize(b, p=2, dim=1).T


def _shrink(embeddings: torch.Tensor, dim: int) -> torch.Tensor:
    """MatryoshkaLoss's shrink: the leading `dim` dimensions, L2-normalised (in fp32 for half types)."""
    cut = embeddings[..., :dim]
    dtype = cut.dtype
    if dtype in (torch.float16, torch.bfloat16):
        cut = cut.float()
    return F.normalize(cut, p=2, dim=-1).to(dtype)


@dataclass
class ContrastiveLoss:
    scale: float = 20.0
    symmetric: bool = False
    matryoshka_dims: tuple[int, ...] = ()
    matryoshka_weights: tuple[float, ...] = ()
    group: object = None  # the data-parallel process group whose candidates are shared (None: this rank's only)
    rank: int = 0  # this rank's place in `group`
    _weights: tuple[float, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"the contrastive scale must be > 0 (got {self.scale})")
        if self.matryoshka_weights and len(self.matryoshka_weights) != len(self.matryoshka_dims):
            raise ValueError(f"{len(self.matryoshka_weights)} Matryoshka weights for {len(self.matryoshka_dims)} dimensions")
        self._weights = tuple(self.matryoshka_weights) or (1.0,) * len(self.matryoshka_dims)

    def __call__(self, anchors: torch.Tensor, positives: torch.Tensor,
                 negatives: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The mean loss of this rank's anchors ([B, H] each; `negatives`: k tensors [B, H], the
        j-th hard negative of every anchor)."""
        documents = [positives] + list(negatives or [])
        if not self.matryoshka_dims:
            return self._info_nce(anchors, documents)
        loss = anchors.new_zeros(())
        for dim, weight in zip(self.matryoshka_dims, self._weights):
            loss = loss + weight * self._info_nce(_shrink(anchors, dim), [_shrink(d, dim) for d in documents])
        return loss

    def _info_nce(self, queries: torch.Tensor, documents: list[torch.Tensor]) -> torch.Tensor:
        local = queries.shape[0]
        offset = 0
        if self.group is not None:
            queries = all_gather_with_grad(queries, self.group)
            documents = [all_gather_with_grad(d, self.group) for d in documents]
            offset = self.rank * local
        mine = torch.arange(offset, offset + local, device=queries.device)
        rows = torch.arange(local, device=queries.device)
        local_queries, local_positives = queries[mine], documents[0][mine]
        scores = [_cosine(local_queries, torch.cat(documents, dim=0)) * self.scale]  # query -> documents
        if self.symmetric:
            scores.append(_cosine(queries, local_positives).T * self.scale)  # document -> queries
        positive = scores[0][rows, mine]
        log_z = sum(torch.logsumexp(s, dim=1) for s in scores) / len(scores)
        return -(positive - log_z).mean()
