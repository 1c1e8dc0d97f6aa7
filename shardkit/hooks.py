"""GroupState: the hooks of one ``fully_shard`` call (the root's bookkeeping is in root.py).

The life of a step, for one group (see docs/design.md for the sequence diagram):

- pre-forward hook: the first forward lazily initializes the root; then unshard (ONE
  all-gather per dtype; usually already issued by the previous group's prefetch), issue
  the all-gather of the group that came next in the last forward (forward prefetch), and
  put a ``_PostBackward`` node on the inputs.
- post-forward hook: reshard if ``reshard_after_forward``, and hook every output tensor so
  its gradient triggers the pre-backward.
- pre-backward (output gradient hook): unshard again (if resharded), issue the all-gather
  of the group whose forward finished before this one's (backward prefetch), and make sure
  the root's final callback is queued.
- post-backward (``_PostBackward.backward``, after the group's gradients are accumulated):
  issue ONE reduce-scatter per dtype, reshard, and finish the previous group's
  reduce-scatter (it ran during this group's backward) into its sharded ``.grad``.
- the root's final callback: groups whose post-backward never fired (the root, whose inputs
  are token ids; groups whose inputs need no grad) reduce now; every reduce-scatter is
  finished (the optimizer step follows); all groups return to IDLE.

At most two all-gathers are in flight (the current group's and one prefetched), and two
reduce-scatters.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from shardkit import lockstep
from shardkit.param_group import ParamGroup
from shardkit.policies import MixedPrecisionPolicy
from shardkit.root import MAX_REDUCING, RootContext, _reset_state, class_name, state_of
from shardkit.state import Phase, PhaseEvent, PhaseMachine
from shardkit.tensors import cast_floating, iter_tensors, to_device


class GroupState:
    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        group: ParamGroup | None,
        reshard_after_forward: bool | None,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    ) -> None:
        self.modules = modules
        self.group = group
        self.device = device
        self.mp_policy = mp_policy
        self.unshard_in_backward = True  # set_unshard_in_backward(False): backward needs no parameters
        self.lockstep_requested = False  # set_lockstep() on the root, before its first forward
        # Weights tied across groups ("Tied" below): the groups whose parameters this one uses
        # too, the groups that use this one's, and a reduction waiting for those to finish.
        self.borrowed: list[GroupState] = []
        self.borrowers: list[GroupState] = []
        self.deferred_reduce = False
        self.index = -1  # position in ctx.states: the same on every rank
        self.machine = PhaseMachine()
        self.reshard_after_forward_arg = reshard_after_forward  # None: decided at lazy init
        self.reshard_after_forward = True if reshard_after_forward is None else reshard_after_forward
        self.is_root: bool | None = None  # None until the root's lazy init
        self.parent: GroupState | None = None  # the enclosing fully_shard call, if any
        self.ctx: RootContext | None = None
        self.forward_prefetch: list[GroupState] | None = None  # None: implicit
        self.backward_prefetch: list[GroupState] | None = None  # None: implicit
        self._post_forward_indices: list[int] = []  # where this group is in post_forward_order
        self._modules_to_run: set[nn.Module] = set()  # modules of this group yet to run this forward
        self._open_calls = 0  # forward calls entered and not yet left (nesting)
        for module in modules:
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward)
            if group is not None:  # state dicts always see the sharded parameters
                module.register_state_dict_pre_hook(lambda *_: group.reshard())
                module._register_load_state_dict_pre_hook(lambda *_: group.reshard())

    @property
    def name(self) -> str:
        return self.machine.name

    def _lazy_init(self) -> None:
        """Make this state the root of every group below its module (first forward only)."""
        self.ctx = RootContext.build(self)
        self.set_lockstep(self.lockstep_requested)

    def set_lockstep(self, enabled: bool) -> None:
        self.lockstep_requested = enabled
        if self.ctx is None:
            return  # applied at lazy init
        meshes = [s.group.mesh for s in self.ctx.states if s.group is not None]
        self.ctx.lockstep = enabled and bool(meshes)
        if self.ctx.lockstep:  # the tokens go to every rank of the mesh (both dims for HSDP)
            mesh = meshes[0]
            group = mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD
            if mesh.ndim > 1 and mesh.size() != dist.get_world_size():
                raise NotImplementedError("set_lockstep with a 2-D mesh needs the mesh to span every rank")
            self.ctx.lockstep_group, self.ctx.lockstep_world = group, mesh.size()

    # Forward -------------------------------------------------------------------------------
    # torch.compile'd modules run their hooks inside the compiled region; ours allocate and
    # free storage and issue collectives, so dynamo leaves them out (a graph break per hook).
    @torch.compiler.disable
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.is_root is None:
            self._lazy_init()
        if self.machine.phase is Phase.FORWARD:
            # Another module of a multi-module group, or a nested call: forward() inside a
            # method registered with register_fsdp_forward_method (generate), or recursion.
            self._open_calls += 1
            return self._cast_inputs(args, kwargs)
        if self.machine.phase is Phase.PRE_BACKWARD:  # recomputation inside backward
            self.machine.advance(PhaseEvent.PRE_FORWARD)
            self._unshard_now()
            return self._cast_inputs(args, kwargs)
        if self.ctx.forward_root is None:
            self.ctx.forward_root = self
            args, kwargs = self._inputs_to_device(args, kwargs)
        args, kwargs = self._cast_inputs(args, kwargs)
        self.machine.advance(PhaseEvent.PRE_FORWARD)
        self._modules_to_run, self._open_calls = set(self.modules), 1
        self._unshard_now()
        for owner in self.borrowed:
            owner._unshard_now()
        self._prefetch_forward()
        if self.group is not None and torch.is_grad_enabled():
            args, kwargs = _PostBackward.attach(self, args, kwargs)
        return args, kwargs

    @torch.compiler.disable
    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        output = self._cast_output(output)
        if self.machine.phase is Phase.PRE_BACKWARD:  # recomputation: keep parameters for backward
            self.machine.advance(PhaseEvent.POST_FORWARD)
            return output
        self._modules_to_run.discard(module)
        self._open_calls -= 1
        if self._modules_to_run or self._open_calls > 0:
            return output  # other modules of this group still to run, or an outer call is open
        self._finish_forward(output)
        ctx = self.ctx
        if ctx.forward_root is self:
            for state in ctx.states:
                if state.machine.phase is Phase.FORWARD:  # a group of several modules that ran in part
                    state._open_calls = 0
                    state._finish_forward(output)
                elif state.group is not None and state.group._pending:  # prefetched, then not run
                    state.group.reshard()
            ctx.forward_root = None
            ctx.forward_order, ctx.forward_seen = ctx.forward_seen, []
            if ctx.lockstep:
                lockstep.drain(ctx)  # serve the ranks still in their forward
        return output

    def _finish_forward(self, output: Any) -> None:
        pinned = any(b.machine.phase is Phase.FORWARD for b in self.borrowers)  # still needed there
        if self.group is not None and not pinned:
            keep_part = self.group.post_forward_mesh is not None and not self.ctx.lockstep
            if self.reshard_after_forward and keep_part and torch.is_grad_enabled():
                self.group.reshard_to_post_forward()  # keep 1/R for the backward all-gather among R ranks
            elif self.reshard_after_forward:
                self.group.reshard()
            elif not torch.is_grad_enabled():
                # No backward follows, so the step is over: the module shows its sharded
                # parameters again, and keeps the gathered data for the next forward.
                self.group.reshard(free=False)
        for owner in self.borrowed:  # done with the tied weights, unless their own group runs
            if owner.machine.phase is not Phase.FORWARD and owner.reshard_after_forward:
                owner.group.reshard()
        if torch.is_grad_enabled():  # a backward may follow: remember the order, hook the outputs
            self._post_forward_indices.append(len(self.ctx.post_forward_order))
            self.ctx.post_forward_order.append(self)
            for t in iter_tensors(output):
                if t.requires_grad:
                    t.register_hook(self._pre_backward)
        self.machine.advance(PhaseEvent.POST_FORWARD)

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Floating-point tensor inputs to ``param_dtype`` (``MixedPrecisionPolicy``)."""
        dtype = self.mp_policy.param_dtype
        if dtype is None or not self.mp_policy.cast_forward_inputs:
            return args, kwargs
        return cast_floating((args, kwargs), dtype)

    def _cast_output(self, output: Any) -> Any:
        """Floating-point tensor outputs to ``output_dtype`` (``MixedPrecisionPolicy``)."""
        dtype = self.mp_policy.output_dtype
        return output if dtype is None else cast_floating(output, dtype)

    def _inputs_to_device(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The root moves forward inputs to the accelerator, like DDP and FSDP2."""
        return (args, kwargs) if self.device.type == "cpu" else to_device((args, kwargs), self.device)

    # Unshard helpers -----------------------------------------------------------------------
    def _unshard_now(self) -> None:
        if self.group is not None:
            if self.ctx is not None and self.ctx.lockstep:
                lockstep.gather(self)
            else:
                self._unshard_locally()

    def _unshard_locally(self) -> None:
        self.group.unshard()
        self.group.wait_for_unshard()

    def _prefetch(self, backward: bool = False) -> None:
        """Issue this group's all-gather early; its own pre-forward/backward waits for it."""
        if self.group is not None and (self.unshard_in_backward or not backward):
            self.group.unshard()

    def _prefetch_forward(self) -> None:
        """Issue the all-gather of the group that ran after this one in the last forward
        (if this forward has followed the last one so far), or of the explicit list."""
        ctx = self.ctx
        ctx.forward_seen.append(self)
        if ctx.lockstep:
            return  # every all-gather is agreed on at the moment it is needed
        if self.forward_prefetch is not None:
            targets = self.forward_prefetch
        else:
            i, order = len(ctx.forward_seen), ctx.forward_order
            targets = order[i : i + 1] if len(order) >= i and order[i - 1] is self else ()
        for target in targets:
            target._prefetch()

    def _prefetch_backward(self) -> None:
        """Issue the all-gather of the group whose forward finished before this one's (the
        next in backward), or of the explicit list."""
        if self.ctx.lockstep:
            return
        if self.backward_prefetch is not None:
            targets = self.backward_prefetch
        elif self._post_forward_indices:
            i = self._post_forward_indices.pop()
            targets = self.ctx.post_forward_order[i - 1 : i] if i > 0 else ()
        else:
            targets = ()
        for target in targets:
            target._prefetch(backward=True)

    # Backward ------------------------------------------------------------------------------
    @torch.compiler.disable
    def _pre_backward(self, grad: torch.Tensor) -> None:
        if self.machine.phase is Phase.PRE_BACKWARD:
            return  # another output of the same call
        self.machine.advance(PhaseEvent.PRE_BACKWARD)
        if not self.ctx.final_callback_queued:
            self.ctx.final_callback_queued = True
            Variable._execution_engine.queue_callback(self.ctx.finish_backward)
        if self.unshard_in_backward:
            self._unshard_now()
        for owner in self.borrowed:
            owner._unshard_now()
        self._prefetch_backward()

    def _post_backward(self) -> None:
        self.machine.advance(PhaseEvent.POST_BACKWARD)
        if self.group is not None:
            if any(b.machine.phase is not Phase.POST_BACKWARD for b in self.borrowers):
                self.deferred_reduce = True  # a group using our tied weights still adds gradients
            elif self.ctx.lockstep:
                lockstep.reduce(self)
            else:
                self._reduce_now()
        for owner in self.borrowed:
            if owner.deferred_reduce and all(b.machine.phase is Phase.POST_BACKWARD for b in owner.borrowers):
                owner.deferred_reduce = False
                owner._reduce_now(reshard=owner.machine.phase is not Phase.PRE_BACKWARD)

    # Tied: a weight shared by two groups (an embedding tied to an output head sharded by
    # another call) belongs to the group that sharded it first, the owner; the other group
    # registers the same parameter and unshards the owner's group around its own forward
    # and backward. Autograd sums both uses into the one unsharded .grad; the owner reduces
    # it once, after every group using it has passed its post-backward.

    def _reduce_now(self, reshard: bool = True) -> None:
        self.group.reduce_gradients()
        if any(b.machine.phase is Phase.PRE_BACKWARD for b in self.borrowers):
            reshard = False  # that group's backward may still read the tied weights
        if reshard and self.group.reshard_after_backward:
            self.group.reshard()
        # Finish the reduce-scatters that completed while this group's backward ran, and
        # the oldest if more than MAX_REDUCING are in flight.
        reducing = self.ctx.reducing
        reducing.append(self.group)
        done = []
        for group in reducing:  # in issue order, stopping at the first not done
            done.append(group.reduce_progress())
            if not done[-1]:
                break
        while len(reducing) > MAX_REDUCING or (len(reducing) > 1 and done and done[0]):
            done.pop(0)
            reducing.pop(0).finish_reduce()

    def reset_iter_state(self) -> None:
        """Return every group under this root to IDLE and sharded after an aborted step."""
        if self.ctx is not None:
            self.ctx.reset()
        else:
            _reset_state(self)


class _PostBackward(torch.autograd.Function):
    """Identity on a group's forward inputs; its backward runs once the group's gradients exist."""

    @staticmethod
    def forward(ctx, state: GroupState, *inputs: torch.Tensor):
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.state._post_backward()
        return (None, *grads)

    @staticmethod
    def attach(state: GroupState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        flat, spec = tree_flatten((args, kwargs))
        where = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not where:
            return args, kwargs  # the root's final callback will reduce this group
        outs = _PostBackward.apply(state, *(flat[i] for i in where))
        for i, out in zip(where, outs):
            flat[i] = out
        return tree_unflatten(flat, spec)
