"""Facts the profiler reads off the platform and the loaded model: card count and model memory,
in all and by part (what pipeline stages are made of).

Owns the two questions the ``Platform`` interface does not answer directly. Reads only; measures
no time.
"""

from __future__ import annotations

import torch

from kunlun_runtime.platforms import Platform


def count_cards(platform: Platform) -> int:
    """Cards this process may use: CPU 1, CUDA the visible devices, Kunlun the visible cards."""
    if platform.name == "kunlun":
        # Imported here, as in platforms.detect: kunlun_device is needed only where a card is.
        from kunlun_runtime.platforms.kunlun import KunlunPlatform

        assert isinstance(platform, KunlunPlatform)
        return platform.num_cards()
    if platform.name == "cuda":
        return torch.cuda.device_count()
    return 1


def model_bytes(model: torch.nn.Module) -> int:
    """Memory of every tensor the model holds: parameters, buffers and plain tensor attributes
    (prepacked linear weights live there), each storage counted once."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        attributes = (value for value in vars(module).values() if isinstance(value, torch.Tensor))
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False), *attributes):
            if tensor.is_mkldnn:  # opaque blocked layout: no shared storage to look through
                key, size = id(tensor), tensor.numel() * tensor.element_size()
            else:
                storage = tensor.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
            if key not in seen:
                seen.add(key)
                total += size
    return total


def part_bytes(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """(one decoder layer, the token embedding, the final norm with lm_head) in bytes, each part on
    its own (a tied lm_head counted in full: a last stage that is not the first holds a copy);
    None for a model without those parts. Layers are all alike, so the largest stands for each."""
    layers = getattr(model, "layers", None)
    parts = [getattr(model, name, None) for name in ("embed_tokens", "norm", "lm_head")]
    if not (isinstance(layers, torch.nn.ModuleList) and len(layers) > 0):
        return None
    modules = [part for part in parts if isinstance(part, torch.nn.Module)]
    if len(modules) < len(parts):
        return None
    embedding, norm, head = modules
    layer = max(model_bytes(module) for module in layers)
    return layer, model_bytes(embedding), model_bytes(norm) + model_bytes(head)
