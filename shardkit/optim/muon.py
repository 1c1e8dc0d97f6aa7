"""Muon on sharded parameters: ``torch.optim.Muon``'s step, each matrix orthogonalized once.

``torch.optim.Muon`` defines the semantics: per matrix, the momentum ``B <- mu B + (1 - mu) g``
(a ``lerp``), the Nesterov blend, Newton-Schulz on the full matrix, decoupled weight decay and
the shape-adjusted learning rate. On sharded parameters we split the step where the math
allows:

- the momentum, the Nesterov blend, the weight decay and the update are elementwise: each
  rank runs them on its local shards (the momentum stays sharded like its parameter, so
  ``state_dict()``, DCP and ``shardkit.checkpoint`` save it as any optimizer state);
- Newton-Schulz needs the whole matrix: ``OwnerCompute`` (owners.py) gives each matrix to
  one owner, which runs torch's own Newton-Schulz on the full, contiguous matrix, and sends
  the rows back, all matrices of a bucket in one packed all-to-all each way (on gloo, a
  bucket of small matrices goes to every rank in one all-to-all instead, and each rank runs
  Newton-Schulz on all of them: ``every_rank_below``).

Each owner runs the same ops on the same full tensor as one process does, so fp32 parameters
end bit-identical to single-process ``torch.optim.Muon``. Plain tensors (not sharded) take
the same path with nothing to send. Beyond torch's Muon: expert weights ``[E, M, N]`` are a
batch of matrices, each orthogonalized (and its learning rate adjusted) as a matrix of its
own.

Subclasses change the orthogonalization (``orthogonalize``) and its cost (``cost``); the
transport stays (see ``PolarExpress``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from shardkit.optim.owners import Matrix, OwnerCompute

# torch.optim.Muon's defaults (Keller Jordan's constants).
EPS = 1e-7
DEFAULT_A, DEFAULT_B, DEFAULT_C = 3.4445, -4.7750, 2.0315
DEFAULT_NS_STEPS = 5


def newton_schulz(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz orthogonalization of one matrix (bf16 result): torch's
    own function where the installed torch has it, so that owners compute exactly as it does."""
    return _torch_newton_schulz(grad, ns_coefficients, ns_steps, eps)


def _newton_schulz(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float) -> torch.Tensor:
    # The same ops as torch 2.13's _zeropower_via_newtonschulz, for a torch that lacks it.
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(grad.shape) != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = ns_coefficients
    x = grad.bfloat16()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T  # (n, m) with n <= m: the Gram matrix is the smaller one
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


try:
    from torch.optim._muon import _zeropower_via_newtonschulz as _torch_newton_schulz
except ImportError:  # pragma: no cover - every supported torch has it
    _torch_newton_schulz = _newton_schulz


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's learning-rate adjustment for a matrix of ``shape`` (A, B)."""
    a, b = shape[-2:]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, a / b))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(a, b))
    else:
        ratio = 1.0
    return lr * ratio


def _to_scalar(x: Any) -> Any:
    # torch.optim's: a 1-element tensor lr stays a (0-d) tensor, so that lr * ratio and
    # 1 - lr * weight_decay are computed in its dtype, as torch.optim.Muon computes them.
    return x.squeeze() if isinstance(x, torch.Tensor) and x.dim() != 0 else x


class Muon(Optimizer):
    """``torch.optim.Muon`` for parameters sharded by shardkit or torch's FSDP2 (any DTensor),
    and plain tensors: the same constructor, defaults, errors and results.

    Example::

        fully_shard(block) for each block; fully_shard(model)
        hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and "blocks" in n]
        rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "blocks" in n)]
        muon = shardkit.optim.Muon(hidden, lr=0.02, momentum=0.95)
        adamw = torch.optim.AdamW(rest, lr=3e-4)

    ``bucket_mb`` (keyword only, not in torch's): the full-matrix megabytes that travel in one
    all-to-all; more buckets pipeline transfer and compute, fewer cost fewer collectives.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        bucket_mb: float = 256.0,
    ) -> None:
        # torch.optim.Muon's checks, with its messages.
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if adjust_lr_fn is not None and adjust_lr_fn not in ["original", "match_rms_adamw"]:
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)
        for opt_group in self.param_groups:
            for p in opt_group["params"]:
                if p.ndim not in (2, 3):  # 3: a batch of matrices (MoE experts), beyond torch's Muon
                    raise ValueError(f"Muon only supports 2D parameters whereas we found a parameter with size: {p.size()}")
        self._owners = OwnerCompute(self.cost, int(bucket_mb * 2**20), type(self).__name__, self.every_rank_below)

    # What a subclass changes -------------------------------------------------------------
    def orthogonalize(self, matrix: torch.Tensor, opt_group: dict) -> torch.Tensor:
        """The update direction of one full matrix (2-D, contiguous), in ``result_dtype``."""
        return newton_schulz(matrix, opt_group["ns_coefficients"], opt_group["ns_steps"], opt_group["eps"])

    result_dtype = torch.bfloat16  # what ``orthogonalize`` returns: the updates travel back in it
    # A bucket of matrices whose summed ``cost`` is below this is orthogonalized on every rank,
    # with one all-to-all and no owners (shardkit/optim/owners.py); None: owners.py's choice for
    # the backend (small buckets on gloo, never on NCCL, whose all-to-all is cheaper than the
    # kernels it saves); 0: always owners.
    every_rank_below: float | None = None

    def cost(self, shape: torch.Size) -> float:
        """Relative work of ``orthogonalize`` on a tensor of ``shape``: per Newton-Schulz
        iteration, two (m x m x n) products and one (m x m x m), m the smaller side."""
        batch = shape[0] if len(shape) == 3 else 1
        m, n = sorted(shape[-2:])
        return batch * (2 * m * m * n + m**3)

    # The step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Performs a single optimization step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = []  # (param, opt_group, matrix, where): the momentum-blended gradients, this rank's pieces
        for g, opt_group in enumerate(self.param_groups):
            for k, p in enumerate(opt_group["params"]):
                if p.grad is None:
                    continue
                if torch.is_complex(p):
                    raise RuntimeError("Muon does not support complex parameters")
                if p.grad.is_sparse:
                    raise RuntimeError("Muon does not support sparse gradients")
                where = f"parameter {k} of param group {g} (shape {list(p.shape)})"
                todo.append((p, opt_group, self._momentum(p, opt_group, where), where))
        matrices = [matrix for _, _, matrix, _ in todo]
        updates = self._owners.map(matrices, lambda i, full: self._orthogonalize_all(full, todo[i][1]), self.result_dtype)
        for (p, opt_group, _, _), update in zip(todo, updates):
            self._apply(p, update, opt_group)
        return loss

    def _momentum(self, p: torch.Tensor, opt_group: dict, where: str) -> Matrix:
        """B <- lerp(B, g, 1 - mu), and the Nesterov blend, on this rank's shards; returns
        the update to orthogonalize, this rank's piece placed as the gradient."""
        grad = p.grad
        if isinstance(p, DTensor) != isinstance(grad, DTensor) or (
            isinstance(p, DTensor) and (grad.placements != p.placements or grad.device_mesh != p.device_mesh)
        ):
            raise ValueError(
                f"Muon: {where}: its gradient is placed {_placed(grad)} but the parameter {_placed(p)}; "
                "shardkit.optim.Muon needs the gradient sharded like its parameter"
            )
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        momentum = opt_group["momentum"]
        buf, g = _local(state["momentum_buffer"]), _local(grad)
        if g.ndim not in (2, 3):
            raise ValueError("Param gradient must be a 2D matrix")
        buf.lerp_(g, 1 - momentum)
        update = g.lerp(buf, momentum) if opt_group["nesterov"] else buf
        return Matrix.placed_like(update, grad, where) if isinstance(grad, DTensor) else Matrix.of(update, where)

    def _orthogonalize_all(self, full: torch.Tensor, opt_group: dict) -> torch.Tensor:
        if full.dim() == 2:
            return self.orthogonalize(full, opt_group)
        if len(full) == 0:  # a rank holding no expert of this weight
            return full.new_empty(full.shape, dtype=self.result_dtype)
        return torch.stack([self.orthogonalize(expert, opt_group) for expert in full])  # (E, M, N): each expert

    def _apply(self, p: torch.Tensor, update: torch.Tensor, opt_group: dict) -> None:
        """Decoupled weight decay, then the update at the shape-adjusted learning rate."""
        lr = _to_scalar(opt_group["lr"])
        local = _local(p)
        local.mul_(1 - lr * opt_group["weight_decay"])
        local.add_(update, alpha=-adjust_lr(lr, opt_group["adjust_lr_fn"], p.shape))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _placed(t: torch.Tensor) -> str:
    return f"{list(t.placements)} on {t.device_mesh}" if isinstance(t, DTensor) else "as a plain tensor"
