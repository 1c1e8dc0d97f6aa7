"""One parameter's buffers: the original, the sharded DTensor (+padding), the unsharded form.

Its geometry and dtypes are its ``Layout`` (``layout.py``: values only, frozen); this file
holds the tensors that change, each owned by the one object that changes it. Rows are slices
along ``layout.dim``, split over the last mesh dim (HSDP: replicated over the first). With
tensor parallel, everything below applies to the parameter's TP-local tensor: the unsharded
parameter is a DTensor with the TP placements again, the sharded one a DTensor on the
(dp, tp) mesh (``placements.dp_tp_spec``).

- The **padded shard** (``padded_shard``, ``padded_shape``) is this rank's rows of the
  original parameter followed by zero rows up to ``padded_rows``; it is the all-gather input
  and the storage the optimizer updates in place. It keeps the original dtype, and lives on
  the CPU under ``CPUOffloadPolicy``.
- The **sharded parameter** (``sharded_param``) is an ``nn.Parameter`` wrapping a ``Shard(0)``
  DTensor whose local tensor is a view of the real (unpadded) rows of the padded shard. It is
  what the module holds between steps, so the optimizer and ``state_dict()`` see it.
- The **unsharded parameter** (``unsharded_param``) is what the module holds during forward
  and backward: for a plain parameter the view its ``UnshardedBuffer`` makes of the
  all-gather's output (``unsharded_flat``, ``world * shard_numel`` elements in
  ``param_dtype``); the object lives for the whole run, only its storage is freed and refilled.
- A parameter whose local shard has FSDP2's all-gather hooks (torchao's float8, NF4) gets its
  unsharded form from them instead (``extension.py``).
- The **post-forward shard** (``post_forward_shard``), with ``reshard_after_forward=R`` (an
  int): this rank's ``1/R`` of the unsharded parameter, kept from the end of forward to the
  backward all-gather among ``R`` ranks, laid out as the unsharded buffer's first rows.

Dtypes (the layout's): ``dtype`` is the original one (sharded parameter, its ``.grad``,
optimizer state); ``param_dtype`` the all-gather's and the compute's; ``reduce_dtype`` the
gradients' reduction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from shardkit.dtensor import extension
from shardkit.dtensor.layout import Layout, layout_of
from shardkit.dtensor.placements import sharded_spec, to_dtensor
from shardkit.dtensor.storage import free_storage
from shardkit.core.options import ParamOptions


@dataclass(frozen=True)
class ParamSlot:
    """Where a parameter is registered: ``module._parameters[name]``."""

    module: nn.Module
    name: str


def sparse_grad_error(what: str, layout: torch.layout) -> str:
    """A gradient that is not dense (``nn.Embedding(sparse=True)``): what to do instead."""
    return (f"shardkit: {what} got a gradient of layout {layout}; fully_shard reduce-scatters dense gradients only. "
            "Build the module with sparse=False (nn.Embedding, nn.EmbeddingBag), or pass the parameter in ignored_params.")


class UnshardedBuffer:
    """A plain parameter's unsharded form: the all-gather's output (``flat``, ``world *
    shard_numel`` elements in ``param_dtype``, on the compute device), the same bytes as
    ``world`` padded shards along ``dim`` (``padded``), and the parameter registered during
    forward and backward (``param``: a view of the real rows; for tensor parallel a DTensor with
    the TP placements). Made once; only its storage is freed and refilled, through ``flat``, a
    ``.data`` alias with its own version counter (docs/design.md says why). World * padded_rows
    >= R * ceil(rows / R) for every R dividing world: a post-forward all-gather's output fits too."""

    def __init__(self, layout: Layout, device: torch.device, tp_spec: DTensorSpec | None, requires_grad: bool) -> None:
        flat = torch.empty(layout.world * layout.shard_numel, dtype=layout.param_dtype, device=device)
        padded = flat.view(layout.unsharded_padded_shape)
        view = padded.narrow(layout.dim, 0, layout.shape[layout.dim])  # (*shape): contiguous for dim 0
        if tp_spec is not None:  # tensor parallel: hand TP its local DTensor
            meta = TensorMeta(tp_spec.shape, tp_spec.stride, layout.param_dtype)
            view = DTensor(view, DTensorSpec(tp_spec.mesh, tp_spec.placements, meta), requires_grad=False)
        self.param = nn.Parameter(view, requires_grad=requires_grad)
        self.flat = flat.data  # same storage, own version counter
        self.padded = self.flat.view(padded.shape)
        # Kept to free and refill it every step without making a storage object each time.
        self._storage, self._nbytes = flat.untyped_storage(), flat.numel() * flat.element_size()
        self._storage_id = self._storage._cdata  # what the parameter views, unless the module replaced its data
        free_storage(self.flat)

    def free(self) -> None:
        self._storage.resize_(0)

    def alloc(self) -> None:
        """Make room for the all-gather's output again (``free`` let it go)."""
        if self._storage.size() != self._nbytes:
            self._storage.resize_(self._nbytes)

    def data_replaced(self) -> bool:
        """Whether the module gave the parameter other data (``param.data = ...`` in forward)."""
        return self.param.untyped_storage()._cdata != self._storage_id


class ShardedParam:
    def __init__(
        self,
        param: nn.Parameter,
        slots: list[ParamSlot],
        mesh: DeviceMesh,
        device: torch.device,
        options: ParamOptions = ParamOptions(),
        dim: int = 0,
        spmd=None,
    ):
        if param.dim() == 0:
            raise ValueError(
                f"fully_shard cannot shard the scalar parameter '{slots[0].name}' of "
                f"{type(slots[0].module).__name__}: make it a 1-D tensor with one element."
            )
        self.slots = slots
        self.fqn = slots[0].name  # replaced by the full name at lazy init (named)
        self.mesh = mesh  # 1-D, or 2-D (replicate, shard)
        self.tp_spec: DTensorSpec | None = param._spec if isinstance(param, DTensor) else None
        self.dp_dims = spmd.dims if spmd is not None else frozenset()  # the full mesh's data-parallel dims
        local = param._local_tensor if self.tp_spec is not None else param  # what FSDP shards
        self.options = options
        self.device = device  # where the unsharded parameter lives and the collectives run
        where = f"parameter '{slots[0].name}' of {type(slots[0].module).__name__}"
        spec = sharded_spec(mesh, self.tp_spec, local.shape, local.dtype, dim, spmd, where)
        self.layout: Layout = layout_of(local.shape, local.dtype, options, world=mesh.size(mesh.ndim - 1),
                                        rank=mesh.get_local_rank(mesh.ndim - 1), dim=dim, spec=spec, param=param)
        self.extension = extension.of(local, where)
        self.post_forward_shard: torch.Tensor | None = None
        self._init_requires_grad = param.requires_grad
        self.unsharded_param: nn.Parameter | None = None  # made at lazy init (plain: buffer.param), or by the hooks
        self.buffer: UnshardedBuffer | None = None  # a plain parameter's unsharded form, made at lazy init
        self._shard_mesh: DeviceMesh | None = None  # the hooks' 1-D mesh, made at the first all-gather
        self.accumulated_grad: torch.Tensor | None = None  # unreduced grads (no gradient sync)
        self._data_replaced = False  # the module gave the unsharded parameter other data (see to_sharded)
        self._shard(local.detach(), device)

    # The layout's values, read where the runtime needs them (the layout itself never changes:
    # a .to() or a reshard_after_forward=int makes a new one).
    shape = property(lambda self: self.layout.shape, doc="What FSDP shards: the TP-local shape under tensor parallel.")
    dtype = property(lambda self: self.layout.dtype)
    param_dtype = property(lambda self: self.layout.param_dtype)
    reduce_dtype = property(lambda self: self.layout.reduce_dtype)
    dim = property(lambda self: self.layout.dim)
    world = property(lambda self: self.layout.world)
    rank = property(lambda self: self.layout.rank)
    spec = property(lambda self: self.layout.spec)
    padded_rows = property(lambda self: self.layout.padded_rows)
    local_rows = property(lambda self: self.layout.local_rows)
    padded_shape = property(lambda self: self.layout.padded_shape)
    shard_numel = property(lambda self: self.layout.shard_numel)
    post_forward_numel = property(lambda self: self.layout.post_forward_numel)
    unsharded_flat = property(lambda self: self.buffer.flat, doc="The all-gather's output (a plain parameter's).")
    unsharded_padded = property(lambda self: self.buffer.padded)

    @property
    def offload(self) -> bool:
        return self.options.offload

    @property
    def pin_memory(self) -> bool:
        return self.options.pin_memory and self.options.offload and self.device.type != "cpu"  # pinning needs an accelerator

    def named(self, fqn: str) -> None:
        """Its full name, known at lazy init (the root's FQNs)."""
        self.fqn = fqn

    def _my_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full (TP-local) tensor (a view). ``torch.chunk``, as in FSDP2:
        tensor subclasses (NF4) support it where they do not support slicing."""
        chunks = torch.chunk(full, self.world, self.dim) if self.local_rows else ()
        return chunks[self.rank] if self.rank < len(chunks) else full.narrow(self.dim, self.shape[self.dim], 0)

    def _shard(self, full: torch.Tensor, device: torch.device) -> None:
        """Build the padded shard and the sharded DTensor parameter from a full tensor."""
        if self.offload:
            device = torch.device("cpu")
        device = full.device if full.device.type == "meta" else device  # meta stays meta until to_empty
        pin = self.pin_memory and device.type == "cpu"
        if self.extension is not None:  # keep the subclass: it makes its own zeros
            padded = full.new_zeros(self.padded_shape).to(device)
            padded = padded.pin_memory() if pin else padded
        else:
            padded = torch.zeros(self.padded_shape, dtype=self.dtype, device=device, pin_memory=pin)
        if device.type != "meta":
            with torch.no_grad():
                self._valid(padded).copy_(self._my_rows(full))
        self._set_padded_shard(padded)

    def _set_padded_shard(self, padded: torch.Tensor) -> None:
        self.padded_shard = padded  # padded_shape
        local = self._valid(padded)  # what DTensor sees: local_rows along dim
        self.sharded_param = nn.Parameter(to_dtensor(local, self.spec), requires_grad=self._init_requires_grad)
        self.sharded_param._shardkit_owned = True  # marks "already managed" for fully_shard

    @property
    def requires_grad(self) -> bool:
        """Follows the sharded parameter: users freeze (``requires_grad_(False)``) what they see."""
        return self.sharded_param.requires_grad

    def _valid(self, padded: torch.Tensor) -> torch.Tensor:
        """The real rows of a padded shard (a view)."""
        return padded.narrow(self.dim, 0, self.local_rows)

    def local_grad(self, reduced: torch.Tensor) -> torch.Tensor:
        """This rank's real gradient rows from its flat reduced chunk (shard_numel,)."""
        rows = reduced.view(self.padded_shape)
        return rows if self.local_rows == self.padded_rows else self._valid(rows)

    def copy_out(self, gathered: torch.Tensor) -> None:
        """The gathered padded shards, rank-major ``(world, shard_numel)``, of a parameter split
        along a dim other than 0 into the unsharded buffer: rank r's rows go to the r-th block of
        that dim. (Along dim 0 the layouts are the same bytes: ``GatherBucket.copy_out`` copies them whole.)"""
        d = self.dim
        target = self.unsharded_padded.view(*self.shape[:d], self.world, self.padded_rows, *self.shape[d + 1 :])
        target.copy_(gathered.view(self.world, *self.padded_shape).movedim(0, d))

    def chunk_grad_into(self, grad: torch.Tensor, target: torch.Tensor) -> None:
        """Lay a full-size gradient out as ``world`` padded shards in ``target (world, shard_numel)``
        (what ``torch._chunk_cat`` does for dim 0)."""
        d = self.dim
        if grad.shape[d] != self.world * self.padded_rows:
            padded = grad.new_zeros(self.unsharded_padded.shape)
            padded.narrow(d, 0, self.shape[d]).copy_(grad)
            grad = padded
        chunks = grad.view(*self.shape[:d], self.world, self.padded_rows, *self.shape[d + 1 :])
        target.view(self.world, *self.padded_shape).copy_(chunks.movedim(d, 0))

    @property
    def shard_device(self) -> torch.device:
        """Where the sharded parameter lives: the compute device, or the CPU when offloaded."""
        return self.padded_shard.device

    def set_post_forward(self, world: int, index: int) -> None:
        """Configure ``reshard_after_forward=world``: this rank keeps chunk ``index`` of ``world``
        (dim-0 parameters only: their unsharded buffer is laid out by rows)."""
        why = f"sharded on dim {self.dim}" if self.dim != 0 else "with fsdp_pre_all_gather" if self.extension else ""
        if why:
            raise NotImplementedError(
                f"reshard_after_forward={world} (an int) with parameter '{self.fqn}' {why} is not "
                "supported; pass True or False."
            )
        self.layout = self.layout.with_post_forward(world, index)

    def keep_post_forward_shard(self) -> None:
        """Copy this rank's chunk of the unsharded buffer aside (before the buffer is freed)."""
        n, i = self.layout.post_forward_numel, self.layout.post_forward_index
        self.post_forward_shard = self.unsharded_flat[i * n : (i + 1) * n].clone()  # (post_forward_numel,)

    def refresh_extension(self) -> None:
        """At lazy init: take the all-gather hooks the local shard has now. FSDP2 lets users
        attach them to the local tensor object after ``fully_shard`` (and after ``to_empty``,
        which makes a new one), up to the first forward: ``param._local_tensor.fsdp_pre_all_gather
        = fn.__get__(param._local_tensor)``."""
        found = extension.of(self.sharded_param._local_tensor, f"parameter '{self.fqn}'")
        if (found is None) == (self.extension is None):
            return
        if found is not None and self.post_forward_numel:
            raise NotImplementedError(
                f"reshard_after_forward=<int> with parameter '{self.fqn}' with fsdp_pre_all_gather is not supported; pass True or False."
            )
        self.extension = found
        self._drop_unsharded()  # made by the hooks, or as a plain buffer

    def alloc_unsharded(self) -> None:
        """Create the unsharded parameter once (storage freed until the first unshard); a
        parameter with the all-gather hooks gets it from them, at its first all-gather."""
        if self.unsharded_param is not None or self.extension is not None:
            return
        self.buffer = UnshardedBuffer(self.layout, self.device, self.tp_spec, self.requires_grad)
        self.unsharded_param = self.buffer.param
        self._data_replaced = False

    def _drop_unsharded(self) -> None:
        """Forget the unsharded form (its buffers with it): a new one is made at the next lazy init."""
        self.unsharded_param, self.buffer = None, None

    def all_gather_inputs(self) -> list[torch.Tensor]:
        """What this parameter's all-gather carries, flat: its padded shard (cast and moved on
        copy-in), or the inputs its ``fsdp_pre_all_gather`` returns (extension.py)."""
        if self.extension is None:
            return [self.padded_shard.view(-1)]
        if self._shard_mesh is None:
            self._shard_mesh = extension.shard_mesh(self.mesh)
        local = self.sharded_param._local_tensor
        local = local.to(self.device, non_blocking=True) if local.device != self.device else local
        module, policy = self.slots[0].module, self.options.mp_policy
        return self.extension.inputs(local, self._shard_mesh, self.shape, self.padded_shape, module, policy)

    def gathered(self) -> None:
        """The all-gather's outputs are in place: a parameter with the hooks builds (or updates)
        its unsharded form from them."""
        if self.extension is not None:
            local = self.sharded_param._local_tensor
            self.unsharded_param = self.extension.build(local, self.unsharded_param, self.shape, self.param_dtype, self.tp_spec, self.requires_grad)

    def free_unsharded(self) -> None:
        if self.extension is not None:
            self.extension.free()
        else:
            self.buffer.free()

    def alloc_unsharded_storage(self) -> None:
        """Make room for the all-gather's output again (``free_unsharded`` let it go)."""
        self.buffer.alloc()

    # Registration on the modules ----------------------------------------------------------------
    def put_on_modules(self, param: nn.Parameter) -> None:
        """The one place a parameter is put on the modules: every slot it is registered in."""
        for slot in self.slots:
            slot.module._parameters[slot.name] = param

    def add_slots(self, slots: list[ParamSlot], unsharded: bool) -> None:
        """More places that register this parameter (a weight tied across groups): they get the
        form the modules hold now."""
        self.slots.extend(slots)
        self.put_on_modules(self.unsharded_param if unsharded else self.sharded_param)

    def to_unsharded(self) -> None:
        """Register the unsharded parameter (after an all-gather, or kept data)."""
        param = self.unsharded_param
        if param.requires_grad != self.requires_grad:
            param.requires_grad_(self.requires_grad)
        if self._data_replaced:
            self._refill_module_data()
        self.put_on_modules(param)

    def to_sharded(self) -> None:
        """Register the sharded parameter again (reshard), after checking what the modules did
        with the unsharded one meanwhile (the rare cases: see "What users replace")."""
        for slot in self.slots:
            held = slot.module._parameters.get(slot.name)
            if held is not self.unsharded_param and held is not self.sharded_param:
                raise RuntimeError(
                    f"shardkit: {type(slot.module).__name__}.{slot.name} (parameter '{self.fqn}') was replaced by a "
                    "new object while unsharded, e.g. `module.weight = nn.Parameter(...)` in forward. shardkit would "
                    "lose its gradient and keep training the old one. Change the parameter's data instead "
                    "(`module.to(dtype)` is followed), or use a plain tensor attribute for the copy."
                )
        if self.extension is None and self.tp_spec is None:  # did the module give it other data?
            self._data_replaced = self.buffer.data_replaced()
        self.put_on_modules(self.sharded_param)

    # What users replace ----------------------------------------------------------------------
    # - ``module._apply`` (``.to(...)``, ``to_empty``) swaps the sharded parameter's data:
    #   ``reset_from_registered`` re-derives the padded shard from it.
    # - Before the first forward a parameter may be assigned anew (``m.w = nn.Parameter(t)``, or
    #   ``load_state_dict(sd, assign=True)`` after meta-device init): ``adopt_registered`` takes
    #   it at lazy init, as FSDP2 does.
    # - ``load_state_dict`` with full tensors: ``shard_of_full`` cuts this rank's shard of each.
    # - During forward a module may change its own parameter's data (HF SwitchTransformers'
    #   router runs ``self.classifier = self.classifier.to(torch.float32)``, which sets
    #   ``param.data`` to an fp32 copy): ``to_sharded`` notices, and from then on every
    #   ``to_unsharded`` refills the module's data (``_refill_module_data``). A new Parameter
    #   object there cannot be followed: ``to_sharded`` raises.
    def reset_from_registered(self) -> None:
        """Re-derive the padded shard after ``module._apply`` (``to_empty``, ``.to``) swapped its data."""
        registered = self.slots[0].module._parameters[self.slots[0].name]
        local = registered._local_tensor
        if local.device.type == "meta":
            padded = local.new_empty(self.padded_shape)
        elif backs(self.padded_shard, local):
            padded = self.padded_shard  # nothing moved
        elif type(local) is torch.Tensor and local.shape == self.padded_shape and local.is_contiguous():
            padded = local  # no padding to add: keep the new tensor (to_empty's pages stay untouched)
        else:
            padded = local.new_zeros(self.padded_shape)
            with torch.no_grad():
                self._valid(padded).copy_(local)
            registered._local_tensor = self._valid(padded)
        # Keep the registered Parameter object (the optimizer may already hold it).
        self.padded_shard, self.sharded_param = padded, registered
        layout = self.layout
        if local.dtype != layout.dtype:  # .to(dtype): derived from the policy again, as at fully_shard (FSDP2 keeps
            # the policy: bf16 params with param_dtype=bf16, then .to(float32), still gather and reduce in bf16)
            layout = layout.with_dtype(local.dtype, self.options, registered)
        self.layout = layout.with_spec(registered._spec)
        self._drop_unsharded()
        self.extension = extension.of(local, self.fqn)

    def adopt_registered(self) -> None:
        """At lazy init: take what the module holds if it is no longer our sharded parameter. A
        DTensor like ours is adopted; a full tensor (FSDP2 raises) is sharded into a new one."""
        slot = self.slots[0]
        registered = slot.module._parameters[slot.name]
        if registered is self.sharded_param or registered is self.unsharded_param:
            return  # ours (unsharded: an explicit unshard() before the first forward)
        where = f"{type(slot.module).__name__}.{slot.name} (parameter '{self.fqn}')"
        if isinstance(registered, DTensor):
            if (registered.shape, registered.placements) != (self.sharded_param.shape, self.spec.placements):
                raise ValueError(
                    f"shardkit: {where} was replaced after fully_shard by a DTensor {list(registered.placements)} of "
                    f"shape {tuple(registered.shape)}; expected {list(self.spec.placements)} of shape "
                    f"{tuple(self.sharded_param.shape)} (a state dict of the same model, sharded the same way)."
                )
            self.reset_from_registered()
        elif self.tp_spec is None and registered.shape == self.shape:
            self._init_requires_grad = registered.requires_grad
            self._shard(registered.detach(), self.device)  # a new Parameter (DTensor has slots: no swap_tensors)
            registered._shardkit_replaced = True  # an optimizer holding it warns at its first step
        else:
            raise ValueError(
                f"shardkit: {where} was replaced after fully_shard by a tensor of shape {tuple(registered.shape)}; "
                f"it can take a full tensor of shape {tuple(self.shape)} before the first forward."
            )
        self.sharded_param._shardkit_owned = True
        self.put_on_modules(self.sharded_param)

    def shard_of_full(self, full: torch.Tensor) -> DTensor:
        """This rank's shard of a full (unsharded, global) tensor, as a DTensor like the sharded
        parameter: for ``load_state_dict`` of plain tensors. No communication."""
        if self.tp_spec is not None:  # the TP-local part first, as tensor parallel would have it
            full = distribute_tensor(full, self.tp_spec.mesh, self.tp_spec.placements, src_data_rank=None)._local_tensor
        return to_dtensor(self._my_rows(full).to(self.shard_device, self.dtype), self.spec)

    def _refill_module_data(self) -> None:
        """The module gave the unsharded parameter other data during a forward: keep its choice
        of dtype and device, and refill it with what was just gathered, so that no step computes
        with an earlier step's values. (``.data``: autograd does not see this as an in-place
        edit; within a step the values are the same.)"""
        data = self.unsharded_param.data
        gathered = self.unsharded_padded.narrow(self.dim, 0, self.shape[self.dim])
        if data.shape != gathered.shape:
            raise RuntimeError(
                f"shardkit: parameter '{self.fqn}' of {type(self.slots[0].module).__name__} was given data of shape "
                f"{tuple(data.shape)} during forward, but it has shape {tuple(gathered.shape)}; shardkit can follow a "
                "change of dtype or device only. Reshape a copy instead of the parameter."
            )
        data.copy_(gathered)

    def drop_post_forward_shard(self) -> None:
        self.post_forward_shard = None

    def drop_grads(self) -> None:
        """Forget the gradients of a failed step (``reset_iter_state``)."""
        if self.unsharded_param is not None:
            self.unsharded_param.grad = None
        self.accumulated_grad = None

    def accumulate_unreduced_grad(self) -> None:
        """Move the unsharded ``.grad`` aside (summed, in ``reduce_dtype``: bf16 sums of many
        microbatches would lose precision) when gradient sync is off."""
        grad = self._local(self.unsharded_param.grad)
        if grad is None:
            return
        self.unsharded_param.grad = None
        if self.accumulated_grad is None:
            self.accumulated_grad = grad.to(self.reduce_dtype)
        else:
            self.accumulated_grad += grad

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """This step's unsharded gradient plus any unreduced ones, detached from the parameter."""
        grad, self.unsharded_param.grad = self._local(self.unsharded_param.grad), None
        if self.accumulated_grad is not None:
            grad = self.accumulated_grad if grad is None else self.accumulated_grad.add_(grad)
            self.accumulated_grad = None
        return grad

    def _local(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """A TP parameter's gradient as the local tensor of the TP placements. On a full SPMD
        mesh the data-parallel dims keep their placement (a Partial there is this rank's part
        of the sum, which the reduce-scatter adds up)."""
        if grad is not None and grad.layout != torch.strided:
            raise RuntimeError(sparse_grad_error(f"parameter '{self.fqn}'", grad.layout))
        if isinstance(grad, DTensor):
            spec = self.tp_spec
            target = tuple(g if i in self.dp_dims else t for i, (g, t) in enumerate(zip(grad.placements, spec.placements)))
            if grad.placements != target:  # e.g. Partial: reduce over tp first, summing in reduce_dtype
                grad = grad.to(self.reduce_dtype).redistribute(spec.mesh, target)
            grad = grad._local_tensor
        return grad

    def set_sharded_grad(self, local_grad: torch.Tensor) -> None:
        """Give the sharded parameter this rank's reduced gradient rows (summing into an existing
        one), in the original dtype and on the shard's device (CPU when offloaded), then run its
        post-accumulate-grad hooks (``register_post_accumulate_grad_hook``: an optimizer step
        per parameter in backward), as FSDP2 does: autograd never accumulates into it."""
        hooks = post_accumulate_grad_hooks(self.sharded_param)
        if local_grad.dtype != self.dtype or local_grad.device != self.shard_device:
            if self.pin_memory and not hooks:  # device-to-host into pinned memory: asynchronous, synced at the end of backward
                host = torch.empty(local_grad.shape, dtype=self.dtype, pin_memory=True)
                local_grad = host.copy_(local_grad, non_blocking=True)
            else:
                local_grad = local_grad.to(self.shard_device, self.dtype)
        grad = self.sharded_param.grad
        if grad is None:
            self.sharded_param.grad = to_dtensor(local_grad, self.spec)
        else:
            grad._local_tensor.add_(local_grad)
        for hook in hooks:  # (a hook reads .grad now: no copy of it may still be in flight)
            hook(self.sharded_param)


def post_accumulate_grad_hooks(param: torch.Tensor) -> list:
    """What ``param.register_post_accumulate_grad_hook`` registered, in order."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    return list(hooks.values()) if hooks else []


def backs(padded: torch.Tensor, local: torch.Tensor) -> bool:
    """Whether ``padded`` still holds ``local``'s data (an empty local shard has no pointer)."""
    if padded.device != local.device or padded.dtype != local.dtype:
        return False
    return local.numel() == 0 or padded.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
