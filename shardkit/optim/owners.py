"""Whole-matrix work on sharded parameters: each matrix goes to one owner rank, and back.

A matrix optimizer (Muon, and any other that transforms each weight matrix as a whole)
needs the full matrix, while each rank holds a piece of it: its rows under FSDP, a block
under FSDP x TP, the same rows as its replicas under HSDP. ``OwnerCompute.map`` runs a
function on every full matrix exactly once in the whole mesh and hands each rank its piece
of every result:

1. **Plan** (once per set of shapes and placements, then cached): where each rank's piece
   sits in the full tensor (``pieces``), and an owner for each matrix, picked to balance
   the function's cost over every rank of the mesh (HSDP replicas included: they share the
   work instead of each redoing it).
2. **In**: every rank sends its pieces to the owners in ONE packed all-to-all per bucket
   (under HSDP, to the owners of its own replica only: the replicas hold the same rows).
3. **Compute**: each owner assembles its matrices, contiguous, exactly as one process would
   hold them, and runs the function on each.
4. **Out**: each owner sends every rank its piece of each result, ONE packed all-to-all per
   bucket over the whole mesh.

Buckets are the matrices of one (mesh, dtype), split by size so that they pipeline: the next
bucket's transfer is in flight while this one computes (on CUDA the all-to-alls run on their
own side stream, ``comm/streams.py``; on the CPU on the process group's thread). Matrices
that each rank holds whole (a plain tensor, a mesh of one rank, experts ``[E, M, N]`` split
on E only) are computed where they are, with no communication.

A bucket whose whole cost is below ``every_rank_below`` has no owners in ``map``: every rank
receives every piece in the one all-to-all of step 2 and computes every matrix itself, so
step 4 is not needed. Where a collective costs more than computing a few small matrices (gloo,
whose all-to-all takes a fraction of a millisecond or more), that halves the step's
collectives; the results are the same bits, the function being the same on the same input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from shardkit.comm import check, trace
from shardkit.comm.streams import Collective, Handle, streams_for
from shardkit.comm.collectives import backend_of
from shardkit.core.meshes import mesh_device

Index = tuple  # per tensor dim: a slice, or a LongTensor of the positions held (strided shards)
# A bucket's cost (``OwnerCompute.cost``, summed) below which gloo computes it on every rank: for
# Muon's cost (multiply-adds per Newton-Schulz iteration) about a millisecond of one CPU core,
# what one gloo all-to-all takes on a few ranks.
EVERY_RANK_BELOW_ON_GLOO = float(2**17)


@dataclass(frozen=True)
class Piece:
    """Where one rank's local tensor sits in the full tensor."""

    index: Index
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def coordinates(mesh: DeviceMesh, pg: dist.ProcessGroup) -> list[tuple[int, ...]]:
    """The mesh coordinates of each rank of ``pg`` (a process group over the mesh's ranks)."""
    out = []
    for r in range(mesh.size()):
        where = (mesh.mesh == dist.get_global_rank(pg, r)).nonzero()
        out.append(tuple(where[0].tolist()))
    return out


def pieces(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence, coords: list[tuple[int, ...]], where: str) -> list[Piece]:
    """Each rank's piece of a tensor of ``shape`` placed on ``mesh``, for the ranks at
    ``coords``: DTensor's own split of each placement, applied to positions instead of
    values, mesh dim by mesh dim as DTensor applies them (each split once per coordinate
    prefix: linear in the ranks)."""
    held = {(): [torch.arange(n) for n in shape]}  # coordinate prefix -> positions per tensor dim
    for dim, p in enumerate(placements):
        if p.is_partial():
            raise ValueError(f"{where}: its gradient is Partial on mesh dim {dim}; reduce it before the optimizer step")
        following = {}
        for prefix, positions in held.items():
            chunks = None
            if _splits(p):
                view = [1] * len(shape)
                view[p.dim] = -1
                chunks, _ = p._split_tensor(positions[p.dim].view(view), mesh.size(dim), with_padding=False)
            for c in range(mesh.size(dim)):
                mine = list(positions)
                if chunks is not None:
                    mine[p.dim] = chunks[c].reshape(-1) if c < len(chunks) else positions[p.dim][:0]
                following[prefix + (c,)] = mine
        held = following
    return [Piece(tuple(_as_slice(ix) for ix in held[c]), tuple(len(ix) for ix in held[c])) for c in coords]


def _splits(p) -> bool:
    """Whether a placement splits the tensor (``_StridedShard``, FSDP x TP's, is no ``Shard``)."""
    return p.is_shard() or isinstance(p, _StridedShard)


def _as_slice(ix: torch.Tensor) -> slice | torch.Tensor:
    if ix.numel() == 0:
        return slice(0, 0)
    start = int(ix[0])
    return slice(start, start + ix.numel()) if torch.equal(ix, torch.arange(start, start + ix.numel())) else ix


def take(full: torch.Tensor, piece: Piece) -> torch.Tensor:
    """``full``'s elements at ``piece``, contiguous."""
    if all(isinstance(ix, slice) for ix in piece.index):
        return full[piece.index]
    out = full
    for dim, ix in enumerate(piece.index):
        out = out[(slice(None),) * dim + (ix,)]
    return out


def put(full: torch.Tensor, piece: Piece, values: torch.Tensor) -> None:
    """Write ``values`` (``piece.shape``) into ``full`` at ``piece``."""
    values = values.view(piece.shape)
    if all(isinstance(ix, slice) for ix in piece.index):
        full[piece.index] = values
        return
    grids = []
    for dim, ix in enumerate(piece.index):
        ix = torch.arange(ix.start, ix.stop) if isinstance(ix, slice) else ix
        view = [1] * full.dim()
        view[dim] = -1
        grids.append(ix.view(view))
    full[tuple(grids)] = values


@dataclass
class Matrix:
    """One matrix (or batch of matrices) to map: this rank's piece and where the rest is."""

    local: torch.Tensor  # this rank's piece (a plain tensor: the whole matrix)
    shape: torch.Size  # the full shape
    mesh: DeviceMesh | None  # None: every rank holds it whole
    placements: tuple = ()
    where: str = ""  # for errors: "parameter 3 of param group 0 (shape [256, 256])"

    @classmethod
    def of(cls, tensor: torch.Tensor, where: str) -> "Matrix":
        if not isinstance(tensor, DTensor):
            return cls(tensor, tensor.shape, None, (), where)
        return cls.placed_like(tensor._local_tensor, tensor, where)

    @classmethod
    def placed_like(cls, local: torch.Tensor, like: DTensor, where: str) -> "Matrix":
        """``local``: this rank's piece of a tensor placed as the DTensor ``like`` (no DTensor made)."""
        mesh, placements = like.device_mesh, tuple(like.placements)
        if mesh.size() == 1 or all(not _splits(p) or (p.dim == 0 and like.dim() == 3) for p in placements):
            for dim, p in enumerate(placements):
                if p.is_partial():
                    raise ValueError(f"{where}: its gradient is Partial on mesh dim {dim}; reduce it before the optimizer step")
            return cls(local, like.shape, None, (), where)  # whole on every rank: experts split on E
        return cls(local, like.shape, mesh, placements, where)


@dataclass
class _Bucket:
    """The matrices of one (mesh, dtype) that travel together, and the plan they travel by."""

    index: list[int]  # positions in the map's input
    mesh: DeviceMesh
    pg: dist.ProcessGroup
    rank: int  # this rank in ``pg`` (= its position in the mesh's ranks)
    owner: list[int]  # per matrix: the owner's rank in ``pg``
    pieces: list[list[Piece]]  # per matrix, per rank
    senders: list[list[int]]  # per matrix: the ranks that send the owner its pieces (one per distinct piece)
    receivers: list[list[int]]  # per matrix: the ranks this rank sends its piece to
    every_rank: bool = False  # no owners: every rank computes every matrix (``owner`` is this rank)
    numel: int = 0  # full elements of its matrices (the same on every rank: for check mode)
    name: str = ""  # "bucket 0", in the trace
    send_in: list[int] = field(default_factory=list)  # all-to-all split sizes, per rank
    recv_in: list[int] = field(default_factory=list)
    send_out: list[int] = field(default_factory=list)
    recv_out: list[int] = field(default_factory=list)


class OwnerCompute:
    """Runs a function on whole matrices held in pieces by a mesh's ranks (see the module doc).

    ``cost(shape)`` estimates the function's work on one full tensor (owners are balanced by
    it); ``bucket_bytes`` caps a bucket's full-matrix bytes, so that buckets pipeline; ``name``
    names the all-to-alls in ``shardkit.trace()``; ``every_rank_below``: the bucket cost below
    which ``map`` computes a bucket on every rank (see the module doc), None for
    ``EVERY_RANK_BELOW_ON_GLOO`` on gloo and 0 (never) on other backends.
    """

    def __init__(self, cost: Callable[[torch.Size], float], bucket_bytes: int, name: str, every_rank_below: float | None = 0.0) -> None:
        self.cost, self.bucket_bytes, self.name, self.every_rank_below = cost, bucket_bytes, name, every_rank_below
        self._plans: dict[tuple, list[_Bucket]] = {}
        self.load: dict[DeviceMesh, list[float]] = {}  # the last plan's cost per rank of each mesh (tests, bench)

    def map(self, matrices: Sequence[Matrix], fn: Callable[[int, torch.Tensor], torch.Tensor], out_dtype: torch.dtype) -> list[torch.Tensor]:
        """For each matrix ``i``, this rank's piece of ``fn(i, full_i)`` (shaped like its
        ``local``). ``fn`` runs once per matrix in the whole mesh, on the full tensor,
        contiguous, and returns ``out_dtype`` (the dtype the results travel back in)."""
        out: list[torch.Tensor | None] = [None] * len(matrices)
        buckets = self._plan(matrices, every_rank=True)
        returning: list[tuple[_Bucket, _Transfer]] = []
        incoming = self._send_in(buckets[0], matrices) if buckets else None
        for b, bucket in enumerate(buckets):
            following = self._send_in(buckets[b + 1], matrices) if b + 1 < len(buckets) else None  # in flight meanwhile
            results = self._compute(bucket, matrices, incoming, fn)
            self._check_dtype(results, out_dtype)
            if bucket.every_rank:
                for j, result in results:
                    out[bucket.index[j]] = take(result, bucket.pieces[j][bucket.rank]).contiguous()
            else:
                returning.append((bucket, self._send_out(bucket, results, out_dtype)))
            incoming = following
        for i, m in enumerate(matrices):  # held whole: computed here while the transfers run
            if m.mesh is None:
                out[i] = fn(i, m.local)
        for bucket, transfer in returning:
            self._unpack_out(bucket, transfer.wait(), out)
        return out

    def gather(self, matrices: Sequence[Matrix], fn: Callable[[int, torch.Tensor], None]) -> None:
        """The first half of ``map``: ``fn(i, full_i)`` runs on each matrix's owner, nothing
        comes back (``shardkit.checkpoint.save_pretrained`` writes each full tensor there).
        Matrices held whole are left to the caller."""
        buckets = self._plan(matrices)
        incoming = self._send_in(buckets[0], matrices) if buckets else None
        for b, bucket in enumerate(buckets):
            following = self._send_in(buckets[b + 1], matrices) if b + 1 < len(buckets) else None
            self._compute(bucket, matrices, incoming, fn)
            incoming = following

    def owned_here(self, matrices: Sequence[Matrix]) -> list[int]:
        """The matrices this rank owns (not those held whole), in the order ``gather`` and
        ``map`` run ``fn`` on them."""
        return [i for bucket in self._plan(matrices) for j, i in enumerate(bucket.index) if bucket.owner[j] == bucket.rank]

    # Plan ---------------------------------------------------------------------------------
    def _plan(self, matrices: Sequence[Matrix], every_rank: bool = False) -> list[_Bucket]:
        """``every_rank``: small buckets may go to every rank (``map``; ``gather``'s function
        must run once per matrix)."""
        key = (every_rank, *((m.shape, m.local.dtype, m.mesh, m.placements) for m in matrices))
        if key not in self._plans:
            self._plans.clear()  # one live plan: a new set of parameters replaces the old
            self._plans[key] = self._build(matrices, every_rank)
        return self._plans[key]

    def _build(self, matrices: Sequence[Matrix], every_rank: bool) -> list[_Bucket]:
        groups: dict[tuple, list[int]] = {}
        for i, m in enumerate(matrices):
            if m.mesh is not None:
                groups.setdefault((m.mesh, m.local.dtype), []).append(i)
        buckets, load = [], {}
        for (mesh, dtype), members in groups.items():
            pg = _process_group(mesh)
            world = mesh.size()
            mesh_load = load.setdefault(mesh, [0.0] * world)
            below = self._every_rank_below(pg) if every_rank else 0.0
            chunk, chunk_bytes = [], 0
            for i in members + [None]:
                nbytes = math.prod(matrices[i].shape) * dtype.itemsize if i is not None else 0
                if chunk and (i is None or chunk_bytes + nbytes > self.bucket_bytes):
                    small = sum(self.cost(matrices[k].shape) for k in chunk) < below
                    buckets.append(self._bucket(len(buckets), chunk, matrices, mesh, pg, mesh_load, small))
                    chunk, chunk_bytes = [], 0
                if i is not None:
                    chunk.append(i)
                    chunk_bytes += nbytes
        self.load = load
        return buckets

    def _every_rank_below(self, pg: dist.ProcessGroup) -> float:
        if self.every_rank_below is not None:
            return self.every_rank_below
        return EVERY_RANK_BELOW_ON_GLOO if backend_of(pg)[0] else 0.0

    def _bucket(self, position: int, index: list[int], matrices: Sequence[Matrix], mesh: DeviceMesh, pg, load: list[float], every_rank: bool) -> _Bucket:
        world = mesh.size()
        rank = dist.get_group_rank(pg, dist.get_rank())
        coords = coordinates(mesh, pg)
        owner = [rank] * len(index)
        # Longest first, each to the least loaded rank so far (over every bucket of this mesh).
        for j in [] if every_rank else sorted(range(len(index)), key=lambda j: (-self.cost(matrices[index[j]].shape), j)):
            owner[j] = min(range(world), key=lambda r: (load[r], r))
            load[owner[j]] += self.cost(matrices[index[j]].shape)
        all_pieces, senders, receivers = [], [], []
        for j, i in enumerate(index):
            m = matrices[i]
            ps = pieces(m.shape, mesh, m.placements, coords, m.where)
            if tuple(m.local.shape) != ps[rank].shape:
                raise ValueError(
                    f"{m.where}: this rank's local tensor has shape {list(m.local.shape)}, but its placements "
                    f"{list(m.placements)} on {mesh} give {list(ps[rank].shape)}"
                )
            replicated = [d for d, p in enumerate(m.placements) if not _splits(p)]
            o = coords[owner[j]]
            senders.append([r for r in range(world) if all(coords[r][d] == o[d] for d in replicated)])
            # (every rank computing: the ranks sharing this one's replica coordinates, both ways)
            receivers.append(senders[-1] if every_rank else [owner[j]] if rank in senders[-1] else [])
            all_pieces.append(ps)
        bucket = _Bucket(index, mesh, pg, rank, owner, all_pieces, senders, receivers, every_rank,
                         sum(math.prod(matrices[i].shape) for i in index), f"bucket {position}")
        bucket.send_in = [sum(ps[rank].numel for j, ps in enumerate(all_pieces) if r in receivers[j]) for r in range(world)]
        bucket.recv_in = [sum(ps[r].numel for j, ps in enumerate(all_pieces) if owner[j] == rank and r in senders[j]) for r in range(world)]
        bucket.send_out = [sum(ps[r].numel for j, ps in enumerate(all_pieces) if owner[j] == rank) for r in range(world)]
        bucket.recv_out = [sum(ps[rank].numel for j, ps in enumerate(all_pieces) if owner[j] == r) for r in range(world)]
        return bucket

    # Transfers ----------------------------------------------------------------------------
    def _send_in(self, bucket: _Bucket, matrices: Sequence[Matrix]) -> Handle:
        parts = [[] for _ in bucket.send_in]
        for j, i in enumerate(bucket.index):
            for r in bucket.receivers[j]:
                parts[r].append(matrices[i].local.reshape(-1))
        send = _cat([t for part in parts for t in part], matrices[bucket.index[0]].local)
        return self._all_to_all(bucket, send, bucket.recv_in, bucket.send_in, "in")

    def _compute(self, bucket: _Bucket, matrices: Sequence[Matrix], incoming: "_Transfer", fn) -> list[tuple[int, torch.Tensor]]:
        received = incoming.wait()
        offsets = _offsets(bucket.recv_in)
        results = []
        for j, i in enumerate(bucket.index):
            if bucket.owner[j] != bucket.rank:
                continue
            m = matrices[i]
            full = m.local.new_empty(m.shape)  # contiguous, as one process holds it
            for r in bucket.senders[j]:
                piece = bucket.pieces[j][r]
                put(full, piece, received[offsets[r] : offsets[r] + piece.numel])
                offsets[r] += piece.numel
            results.append((j, fn(i, full)))
        return results

    def _send_out(self, bucket: _Bucket, results: list[tuple[int, torch.Tensor]], dtype: torch.dtype) -> "_Transfer":
        parts = []
        for r in range(len(bucket.send_out)):
            parts.extend(take(result, bucket.pieces[j][r]).reshape(-1) for j, result in results)
        send = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=mesh_device(bucket.mesh))
        return self._all_to_all(bucket, send, bucket.recv_out, bucket.send_out, "out")

    def _check_dtype(self, results: list[tuple[int, torch.Tensor]], dtype: torch.dtype) -> None:
        if any(result.dtype != dtype for _, result in results):
            raise TypeError(f"{self.name}: the function must return {dtype}, it returned {sorted({str(r.dtype) for _, r in results})}")

    def _unpack_out(self, bucket: _Bucket, received: torch.Tensor, out: list) -> None:
        offsets = _offsets(bucket.recv_out)
        for j, i in enumerate(bucket.index):
            piece = bucket.pieces[j][bucket.rank]
            o = bucket.owner[j]
            out[i] = received[offsets[o] : offsets[o] + piece.numel].view(piece.shape)
            offsets[o] += piece.numel

    def _all_to_all(self, bucket: _Bucket, send: torch.Tensor, recv_sizes: list[int], send_sizes: list[int], way: str) -> "_Transfer":
        world = len(send_sizes)
        name = f"{self.name} {bucket.name} {way}"
        mesh_dim = "*".join(bucket.mesh.mesh_dim_names or [f"dim{d}" for d in range(bucket.mesh.ndim)])
        traced = trace.record("all_to_all", name, dtype=send.dtype, numel=send.numel(), world=world, mesh_dim=mesh_dim) if trace.is_recording() else None
        check.before(bucket.pg, "all_to_all", name, send.dtype, bucket.numel, world)  # the same on every rank
        output = send.new_empty(sum(recv_sizes))

        def launch(async_op: bool):
            work = dist.all_to_all_single(output, send, recv_sizes, send_sizes, group=bucket.pg, async_op=async_op)
            return work, {"output": output}

        handle = streams_for(send.device).issue(Collective("all_to_all", name, traced, backend_of(bucket.pg)[2]), {"input": send}, launch)
        return _Transfer(handle, output)


@dataclass
class _Transfer:
    """An all-to-all in flight and the buffer it receives into."""

    handle: Handle
    output: torch.Tensor

    def wait(self) -> torch.Tensor:
        self.handle.wait()
        return self.output


_mesh_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}  # an unnamed n-D mesh's ranks -> their group


def _process_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """One process group over all of ``mesh``'s ranks (the whole mesh, HSDP's replicas too)."""
    if mesh.ndim == 1:
        return mesh.get_group()
    ranks = tuple(mesh.mesh.flatten().tolist())
    if ranks == tuple(range(dist.get_world_size())):
        return dist.group.WORLD
    if mesh.mesh_dim_names:
        return mesh._flatten().get_group()
    if ranks not in _mesh_groups:  # (DeviceMesh flattens named meshes only)
        _mesh_groups[ranks] = dist.new_group(sorted(ranks), use_local_synchronization=True)
    return _mesh_groups[ranks]


def _cat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else like.new_empty(0)


def _offsets(sizes: list[int]) -> list[int]:
    out, total = [], 0
    for n in sizes:
        out.append(total)
        total += n
    return out
