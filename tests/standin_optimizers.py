"""Small stand-ins for third-party optimizers: the shapes and containers of state they keep, not their maths.

Each keeps what the real one keeps where a checkpoint sees it (no new dependency):
Lion (one momentum), Prodigy (a tensor in ``param_groups``, changed in place by ``step``), AdaFactor
(factored row / column second moments for matrices), SOAP (lists of tensors as state), Lamb (Adam's
state, a per-tensor trust ratio), schedule-free AdamW (float hyper-parameters changed by ``step``), and
an mmengine-style ``OptimWrapper`` (an optimizer-like object that is not a ``torch.optim.Optimizer``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.optim import Optimizer


def stepped(optimizer: Optimizer, group: dict[str, Any]) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
    """Each parameter of ``group`` that has a gradient, with its state (empty before its first step)."""
    for p in group["params"]:
        if p.grad is not None:
            yield p, optimizer.state[p]


class Lion(Optimizer):
    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p, state in stepped(self, group):
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_((exp_avg * beta1 + p.grad * (1 - beta1)).sign(), alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


class Prodigy(Optimizer):
    """Like prodigyopt's: ``d_numerator`` is a tensor in each param group, which ``step`` updates in place."""

    def __init__(self, params: Any, lr: float = 1.0, betas: tuple[float, float] = (0.9, 0.999),
                 beta3: float = 0.99, d0: float = 1e-3, eps: float = 1e-8) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, beta3=beta3, d=d0, d0=d0, eps=eps, k=0))
        for group in self.param_groups:
            group["d_numerator"] = torch.zeros(())

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            group["d_numerator"].mul_(group["beta3"]).add_(group["d0"])  # in place, as prodigyopt's
            group["d"] = max(group["d"], float(group["d_numerator"]) * 0.1)
            group["k"] += 1
            for p, state in stepped(self, group):
                if not state:
                    state["step"] = 0
                    state["s"] = torch.zeros_like(p)
                    state["p0"] = p.detach().clone()
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                state["s"].mul_(beta2).add_(p.grad, alpha=group["d"])
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=group["d"] * (1 - beta1))
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=group["d"] ** 2 * (1 - beta2))
                p.addcdiv_(state["exp_avg"], state["exp_avg_sq"].sqrt().add_(group["d"] * group["eps"]),
                           value=-group["lr"] * group["d"])


class AdaFactor(Optimizer):
    """Factored second moments for matrices (row and column vectors), per element otherwise; no
    per-tensor RMS clipping (so a sharded run matches an unsharded one)."""

    def __init__(self, params: Any, lr: float = 1e-2, decay: float = 0.8, eps: float = 1e-30) -> None:
        super().__init__(params, dict(lr=lr, decay=decay, eps=eps))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p, state in stepped(self, group):
                grad = p.grad
                factored = grad.dim() >= 2
                if not state:
                    state["step"] = torch.tensor(0.0)
                    if factored:
                        state["exp_avg_sq_row"] = torch.zeros(grad.shape[:-1])
                        state["exp_avg_sq_col"] = torch.zeros(grad.shape[:-2] + grad.shape[-1:])
                    else:
                        state["exp_avg_sq"] = torch.zeros_like(grad)
                state["step"] += 1
                beta = 1.0 - float(state["step"]) ** -group["decay"]
                squared = grad * grad + group["eps"]
                if factored:
                    row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
                    row.mul_(beta).add_(squared.mean(dim=-1), alpha=1 - beta)
                    col.mul_(beta).add_(squared.mean(dim=-2), alpha=1 - beta)
                    variance = (row / row.mean(dim=-1, keepdim=True)).unsqueeze(-1) * col.unsqueeze(-2)
                else:
                    state["exp_avg_sq"].mul_(beta).add_(squared, alpha=1 - beta)
                    variance = state["exp_avg_sq"]
                p.add_(grad * variance.rsqrt(), alpha=-group["lr"])


class SOAPLike(Optimizer):
    """SOAP's containers: per parameter, Adam's moments and lists of tensors (``GG``: statistics
    kept as a list, one small matrix per kept dimension, updated each step)."""

    def __init__(self, params: Any, lr: float = 1e-2, beta: float = 0.9) -> None:
        super().__init__(params, dict(lr=lr, beta=beta))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p, state in stepped(self, group):
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["GG"] = [torch.zeros(2, 2), torch.zeros(3)]
                state["step"] += 1
                head = torch.zeros(3)
                head[:min(3, p.grad.numel())] = p.grad.reshape(-1)[:3]
                state["GG"][0].mul_(group["beta"]).add_(torch.outer(head[:2], head[:2]))
                state["GG"][1].mul_(group["beta"]).add_(head)
                state["exp_avg"].mul_(group["beta"]).add_(p.grad)
                p.add_(state["exp_avg"], alpha=-group["lr"] * (1 + float(state["GG"][1].abs().sum()) * 0))


class Lamb(Optimizer):
    def __init__(self, params: Any, lr: float = 1e-2, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p, state in stepped(self, group):
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                update = state["exp_avg"] / state["exp_avg_sq"].sqrt().add(group["eps"])
                update.add_(p, alpha=group["weight_decay"])
                weight_norm, update_norm = p.norm(), update.norm()  # this rank's piece: a per-shard trust ratio
                trust = float(weight_norm / update_norm) if weight_norm > 0 and update_norm > 0 else 1.0
                p.add_(update, alpha=-group["lr"] * min(trust, 10.0))


class ScheduleFreeAdamW(Optimizer):
    """schedulefree's AdamWScheduleFree: ``z`` per parameter, float bookkeeping in the param groups."""

    def __init__(self, params: Any, lr: float = 1e-2, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, warmup_steps: int = 0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, warmup_steps=warmup_steps, k=0,
                                      train_mode=True, weight_sum=0.0, lr_max=-1.0, scheduled_lr=0.0))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            k = group["k"]
            lr = group["lr"]
            group["lr_max"] = lr_max = max(lr, group["lr_max"])
            weight = lr_max ** 2
            group["weight_sum"] = weight_sum = group["weight_sum"] + weight
            ckp1 = weight / weight_sum if weight_sum else 0.0
            group["scheduled_lr"] = lr
            for p, state in stepped(self, group):
                if not state:
                    state["z"] = p.detach().clone()
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (state["exp_avg_sq"] / (1 - beta2 ** (k + 1))).sqrt_().add_(group["eps"])
                state["z"].addcdiv_(p.grad, denom, value=-lr)
                p.lerp_(state["z"], ckp1).addcdiv_(p.grad, denom, value=-lr * (beta1 * (1 - ckp1) - 1) * 0.1)
            group["k"] = k + 1


class OptimWrapper:
    """mmengine's ``OptimWrapper`` shape: holds an optimizer, shows its ``param_groups``, saves and loads
    through it; not a ``torch.optim.Optimizer`` (no ``state`` attribute either)."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()


def make(name: str, params: Any) -> Any:
    """An optimizer by name over ``params``: a stand-in, torch's ``adamw`` / ``sgd``, or ``wrapper`` (AdamW in
    an ``OptimWrapper``)."""
    params = list(params)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "wrapper":
        return OptimWrapper(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01))
    classes = {"lion": Lion, "prodigy": Prodigy, "adafactor": AdaFactor, "soap": SOAPLike, "lamb": Lamb,
               "schedule_free": ScheduleFreeAdamW}
    return classes[name](params)
