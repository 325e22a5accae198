"""The optimizer section: LAMB, AdamW or StableAdamW, weight decay by parameter kind, clipping,
with the rules about its own fields."""
from __future__ import annotations

from dataclasses import dataclass, field

from .checks import non_negative, one_of, positive
from .choices import COMPILE_CHOICES, OPTIMIZERS, PARAMETER_KINDS


@dataclass
class OptimizerConfig:
    name: str = "lamb"  # "lamb" | "adamw" | "stable_adamw"
    lr: float = 1e-3  # peak learning rate (reached at the end of warmup)
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    weight_decay: float = 0.01
    # parameter kinds (PARAMETER_KINDS) excluded from weight decay
    no_weight_decay: list[str] = field(default_factory=lambda: ["bias", "layernorm"])
    # parameter kinds whose LAMB trust ratio is fixed to 1
    no_layer_adaptation: list[str] = field(default_factory=lambda: ["bias", "layernorm"])
    max_trust_ratio: float | None = None  # optional clamp of the LAMB trust ratio
    # global gradient-norm clipping; 0 disables; None: off with stable_adamw (its own update
    # clipping stands in for it, and torch-optimi advises against both), 1.0 otherwise (clip())
    grad_clip: float | None = None
    # stable_adamw only (torch-optimi's StableAdamW): decouple_lr decays weights by
    # (lr_t / max_lr) * weight_decay instead of lr_t * weight_decay; max_lr None = optimizer.lr;
    # kahan_sum: Kahan-compensated updates of bf16/fp16 tensors the optimizer steps
    decouple_lr: bool = False
    max_lr: float | None = None
    kahan_sum: bool = False
    # lamb only: its Adam direction as one compiled kernel per tensor (torch.compile) instead of
    # nine multi-tensor sweeps over memory: "auto" on CUDA, "true" anywhere torch compiles, "false"
    fused: str = "auto"

    STABLE_ADAMW_ONLY = {"decouple_lr": False, "max_lr": None, "kahan_sum": False}

    def clip(self) -> float:
        """The gradient-norm clipping threshold in effect (0 = off): grad_clip, or its default."""
        if self.grad_clip is not None:
            return self.grad_clip
        return 0.0 if self.name == "stable_adamw" else 1.0

    def clipping_words(self) -> str:
        """The gradient clipping in effect, in the start-up line's words."""
        if self.clip() > 0:
            return f"clipped at norm {self.clip():g}"
        own = ": StableAdamW bounds each update itself" if self.name == "stable_adamw" else ""
        return f"not clipped (optimizer.grad_clip 0{own})"

    def problems(self) -> list[str]:
        p: list[str] = []
        one_of(p, "optimizer.name", self.name, OPTIMIZERS)
        positive(p, "optimizer.lr", self.lr)
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                p.append(f"optimizer.{name} ({value}) must be in [0, 1)")
        positive(p, "optimizer.eps", self.eps)
        non_negative(p, "optimizer.weight_decay", self.weight_decay)
        if self.grad_clip is not None:
            non_negative(p, "optimizer.grad_clip", self.grad_clip)
        if self.name != "stable_adamw":
            for key, default in self.STABLE_ADAMW_ONLY.items():
                if getattr(self, key) != default:
                    p.append(f"optimizer.{key} applies to optimizer.name=stable_adamw only, not {self.name}; "
                             "remove it")
        one_of(p, "optimizer.fused", self.fused, COMPILE_CHOICES)
        if self.fused == "true" and self.name != "lamb":
            p.append(f"optimizer.fused=true applies to optimizer.name=lamb only, not {self.name} (adamw always runs "
                     "torch's fused kernel; stable_adamw has no compiled form): remove it or set it to auto")
        if self.max_lr is not None:
            positive(p, "optimizer.max_lr", self.max_lr)
        if self.max_trust_ratio is not None:
            positive(p, "optimizer.max_trust_ratio", self.max_trust_ratio)
        for name in ("no_weight_decay", "no_layer_adaptation"):
            for kind in getattr(self, name):
                if kind not in PARAMETER_KINDS:
                    p.append(f"optimizer.{name} entry {kind!r} is not a parameter kind; "
                             f"valid kinds: {', '.join(PARAMETER_KINDS)}")
        return p
