"""Many adapters in one batch: device slots with LRU eviction, and the layer that adds each row's update (chapter 08).

Unmerged serving keeps the base weights W untouched and computes, for each token row of a step,

    y = x W^T  +  (x A_s^T) B_s^T          s = the slot of the row's adapter (none: the first term only)

The first term is the base matmul, once for the whole batch whatever adapters its rows use; the second is
the batched gather matmul of `minillm.kernels.lora` (Triton on CUDA, `add_lora_reference` elsewhere).

Where the adapters live. `LoRASlots` holds `max_loras` device slots: per layer and PEFT target, one stacked
A [max_loras, max_rank, in] and one B [max_loras, rows, max_rank] (smaller ranks padded with zeros, the scale
folded into B). Registered adapters stay in host memory (`register`); `acquire(name)` copies one into a slot
on demand, evicting the least recently used adapter that no running request holds. A slot held by a running
request is never evicted: `acquire` returns False instead, and the scheduler keeps the request waiting.

Where a step's adapter indices live. The model runner wraps each forward in `with slots.rows(names):`, which
sets `row_slots` [B] (each row's slot, -1 for the base model) for the duration of that forward; every
`LoRALinear` reads it and repeats it over the T tokens of each row. Outside such a block `row_slots` is None
and a `LoRALinear` is exactly its base layer: base-only steps (and CUDA graphs, captured without LoRA) are
unchanged.

    slots = LoRASlots(model, max_loras=4, max_rank=16)
    slots.register("pirate", load_adapter("adapters/pirate", model.config))
    attach_lora(model, slots)                      # qkv_proj, o_proj, gate_up_proj, down_proj -> LoRALinear
    slots.acquire("pirate")                        # pinned in a slot (loaded if it was not)
    with slots.rows(["pirate", None]):             # row 0 with the adapter, row 1 the base model
        logits = model(tokens)                     # tokens [2, T]
    slots.release("pirate")
"""

from __future__ import annotations

import contextlib
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from minillm.kernels import add_lora_reference
from minillm.lora.adapter import TARGETS, LoRAAdapter, check_finite, target_rows
from minillm.model import Transformer, _triton_kernels_run

MODULES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")  # what LoRALinear wraps


def lora_matmul(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                slot_ids: torch.Tensor) -> torch.Tensor:
    """y [N, out] += each row's B A x, in place (see `minillm.kernels.lora`): the Triton kernel on CUDA, the
    PyTorch reference elsewhere. x [N, in], lora_a [S, r, in], lora_b [S, out, r], slot_ids [N] (-1: none)."""
    if _triton_kernels_run(x):
        from minillm.kernels import add_lora

        return add_lora(y, x, lora_a, lora_b, slot_ids)
    return add_lora_reference(y, x, lora_a, lora_b, slot_ids)


class LoRASlots:
    """`max_loras` device slots for adapters of rank <= `max_rank`, filled from host memory on demand (LRU).

    Counters: `loads` (host -> device copies) and `evictions`. See the module's docstring.
    """

    def __init__(self, model: Transformer, max_loras: int, max_rank: int) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_rank must be >= 1, got {max_loras}, {max_rank}.")
        self.config, self.max_loras, self.max_rank = model.config, max_loras, max_rank
        device, dtype = model.device, model.dtype
        self.rows_of = target_rows(model.config)  # target -> (module, first row, rows, in_features)
        # per (layer, target): A [max_loras, max_rank, in], B [max_loras, rows, max_rank], on the model's device
        self.lora_a: dict[tuple[int, str], torch.Tensor] = {}
        self.lora_b: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(model.config.n_layers):
            for target, (_, _, n, d_in) in self.rows_of.items():
                self.lora_a[layer, target] = torch.zeros(max_loras, max_rank, d_in, device=device, dtype=dtype)
                self.lora_b[layer, target] = torch.zeros(max_loras, n, max_rank, device=device, dtype=dtype)
        self.adapters: dict[str, LoRAAdapter] = {}  # every registered adapter, on the host
        self.slot_names: list[str | None] = [None] * max_loras  # which adapter each slot holds
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self.pins: Counter[str] = Counter()  # name -> running sequences using it (never evicted while > 0)
        self.row_slots: torch.Tensor | None = None  # [B]: the current forward's slot per row (see `rows`)
        self._token_slots: dict[int, torch.Tensor] = {}  # T -> row_slots repeated over T tokens, [B * T]
        self.loads = self.evictions = 0
        self.layers: list[LoRALinear] = []  # the model's wrappers reading these slots (`attach_lora`)

    @property
    def nbytes(self) -> int:
        """Device bytes of all slots (A and B of every layer and target)."""
        return sum(t.numel() * t.element_size() for t in [*self.lora_a.values(), *self.lora_b.values()])

    # ------------------------------------------------------------------ adapters and slots
    def register(self, name: str, adapter: LoRAAdapter) -> None:
        """Make `adapter` servable as `name` (kept on the host until a request needs it)."""
        if name in self.adapters:
            raise ValueError(f"a LoRA adapter named {name!r} is registered already: give each adapter its own name.")
        if adapter.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {adapter.rank}, more than the slots' max_rank "
                             f"{self.max_rank}: raise max_lora_rank (--max-lora-rank) to at least {adapter.rank}.")
        self._check_fits(name, adapter)
        self.adapters[name] = adapter

    def _check_fits(self, name: str, adapter: LoRAAdapter) -> None:
        """Refuse (ValueError) an adapter the slots cannot hold or that would make its rows' logits NaN: a layer or
        shape of another model, a NaN or infinity in its weights or alpha, or a value that overflows the slots'
        dtype once scaled (1e30 is finite in fp32, infinite in bf16). `load_adapter` checked a folder's already;
        this covers a `LoRAAdapter` built in memory too, before any request can reach it."""
        check_finite(adapter, name)
        dtype = next(iter(self.lora_b.values())).dtype
        for (layer, target), (a, b) in adapter.weights.items():
            if layer >= self.config.n_layers or target not in self.rows_of:
                raise ValueError(f"LoRA adapter {name!r} has layer {layer} {target}, which this model (of "
                                 f"{self.config.n_layers} layers) lacks: use an adapter trained on this base model.")
            _, _, out, d_in = self.rows_of[target]
            if tuple(a.shape) != (adapter.rank, d_in) or tuple(b.shape) != (out, adapter.rank):
                raise ValueError(f"LoRA adapter {name!r}: layer {layer} {target} has A {tuple(a.shape)} and B "
                                 f"{tuple(b.shape)}, this model needs A ({adapter.rank}, {d_in}) and B ({out}, "
                                 f"{adapter.rank}): use an adapter trained on this base model.")
            if not (torch.isfinite(a.to(dtype)).all() and torch.isfinite((b * adapter.scale).to(dtype)).all()):
                raise ValueError(f"LoRA adapter {name!r}: layer {layer} {target} overflows {dtype} once scaled by "
                                 f"{adapter.scale:g}: serve the model in float32 (--dtype float32), or use an adapter "
                                 "with smaller weights.")

    def slot(self, name: str | None) -> int:
        """The slot `name` occupies (-1 for None, the base model); it must be resident (`acquire`)."""
        return -1 if name is None else self.resident[name]

    def acquire(self, name: str) -> bool:
        """Pin adapter `name` in a slot for one running sequence, copying it in if needed (evicting the least
        recently used unpinned adapter). False, with nothing changed, if every slot is pinned."""
        if name not in self.adapters:
            raise ValueError(f"unknown LoRA adapter {name!r}; registered: {sorted(self.adapters)}.")
        if name not in self.resident:
            free = [s for s, held in enumerate(self.slot_names) if held is None]
            if free:
                slot = free[0]
            else:
                victim = next((n for n in self.resident if self.pins[n] == 0), None)
                if victim is None:
                    return False
                slot = self.resident.pop(victim)
                self.evictions += 1
            self._load(name, slot)
            self.resident[name] = slot
        self.resident.move_to_end(name)  # the most recently used
        self.pins[name] += 1
        return True

    def release(self, name: str) -> None:
        """One running sequence is done with `name`; at no pins its slot may be evicted (it stays loaded)."""
        if self.pins[name] <= 0:
            raise ValueError(f"LoRA adapter {name!r} is not pinned: a release without its acquire.")
        self.pins[name] -= 1

    @torch.no_grad()
    def _load(self, name: str, slot: int) -> None:
        """Copy adapter `name` from the host into `slot`: A rows and B columns past its rank stay zero, and B is
        multiplied by the scale, so the layer computes (x A^T) B^T alone. Targets it lacks are zero."""
        adapter, r = self.adapters[name], self.adapters[name].rank
        for key, a_slots in self.lora_a.items():
            b_slots = self.lora_b[key]
            a_slots[slot].zero_()
            b_slots[slot].zero_()
            if key in adapter.weights:
                a, b = adapter.weights[key]
                a_slots[slot, :r].copy_(a)
                b_slots[slot, :, :r].copy_(b * adapter.scale)
        self.slot_names[slot] = name
        self.loads += 1

    # ------------------------------------------------------------------ one forward
    @contextlib.contextmanager
    def rows(self, names: Sequence[str | None]) -> Iterator[None]:
        """During the block, row b of the model's batch uses adapter names[b] (None: the base model). Each named
        adapter must be resident (acquired)."""
        device = next(iter(self.lora_a.values())).device
        if self.layers and self.layers[0].slots is not self:  # another engine over the same model ran last
            for layer in self.layers:
                layer.slots = self
        self.row_slots = torch.tensor([self.slot(n) for n in names], device=device)  # [B]
        self._token_slots = {}
        try:
            yield
        finally:
            self.row_slots, self._token_slots = None, {}

    def token_slots(self, T: int) -> torch.Tensor:
        """The current forward's slot per token, [B * T] (row b's slot repeated T times), made once per step."""
        if T not in self._token_slots:
            self._token_slots[T] = self.row_slots.repeat_interleave(T)
        return self._token_slots[T]


class LoRALinear(nn.Module):
    """A projection plus the LoRA update of each row's adapter: base(x) + per-target (x A_s^T) B_s^T (chapter 08).

    `base` is the model's own layer (nn.Linear, or a quantised one); `targets` are the PEFT targets inside it,
    each a row slice of the output (q|k|v for qkv_proj, gate|up for gate_up_proj). With no forward under
    `LoRASlots.rows`, it is exactly `base`.
    """

    def __init__(self, base: nn.Module, slots: LoRASlots, layer: int, targets: list[str]) -> None:
        super().__init__()
        self.base, self.slots, self.layer, self.targets = base, slots, layer, targets

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's weight (what code reading `qkv_proj.weight` expects)."""
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, in] -> [B, T, out]: the base matmul once for the batch, then each token's adapter update."""
        y = self.base(x)
        slots = self.slots
        if slots.row_slots is None:
            return y
        B, T, d_in = x.shape
        ids, flat_x, flat_y = slots.token_slots(T), x.reshape(B * T, d_in), y.view(B * T, -1)
        for target in self.targets:
            _, first, n, _ = slots.rows_of[target]
            key = (self.layer, target)
            lora_matmul(flat_y[:, first : first + n], flat_x, slots.lora_a[key], slots.lora_b[key], ids)
        return y


def attach_lora(model: Transformer, slots: LoRASlots) -> None:
    """Wrap the model's qkv_proj, o_proj, gate_up_proj and down_proj in `LoRALinear`s over `slots`, in place.
    (Their state-dict keys gain `.base`: `detach_lora` puts the plain layers back.) A model reads one `LoRASlots`
    at a time: attaching again points the existing wrappers at the new slots, and `LoRASlots.rows` points them
    back at its own (so several engines over one model, as in a notebook, each read their own slots)."""
    targets_of = {module: [t for t in TARGETS if slots.rows_of[t][0] == module] for module in MODULES}
    for i, block in enumerate(model.layers):
        for module in MODULES:
            parent_name, _, child = module.rpartition(".")
            parent = block.get_submodule(parent_name)
            current = getattr(parent, child)
            if isinstance(current, LoRALinear):
                current.slots = slots
            else:
                current = LoRALinear(current, slots, i, targets_of[module])
                setattr(parent, child, current)
            slots.layers.append(current)


def detach_lora(model: Transformer) -> None:
    """Undo `attach_lora`: the plain layers back in place."""
    for block in model.layers:
        for module in MODULES:
            parent_name, _, child = module.rpartition(".")
            parent = block.get_submodule(parent_name)
            current = getattr(parent, child)
            if isinstance(current, LoRALinear):
                setattr(parent, child, current.base)
