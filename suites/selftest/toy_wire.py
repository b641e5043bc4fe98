"""A toy transport a third party could publish: each bucket is text, one line per tensor.

``HexBucket.lines`` holds ``"<name> <dtype> <d0,d1,...> <hex of the bytes>"`` per tensor. It
exists to prove the transport seam: installed under the entry-point group
``weightsync.transports`` (``hex_lines = toy_wire:TRANSPORT``), every suite decodes an
exporter's hex buckets with :meth:`HexLines.decode`, and nothing of the harness names it.
``TOY_WIRE_FLIP`` set in the environment makes the encoder flip one bit of the first tensor
of every bucket (a sender bug the suites must locate). Not shipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pytest_weightsync.transports import Transport, WireFormatError


@dataclass(frozen=True)
class HexBucket:
    """One bucket on the toy wire."""

    lines: tuple


class HexLines(Transport):
    name = "hex_lines"
    docs = "suites/selftest/toy_wire.py"

    def recognises(self, item) -> bool:
        return isinstance(item, HexBucket)

    def encode(self, stream, *, engine_rank: int, engine_tp: int, **options) -> list:
        from pytest_weightsync.transports.shapes import tensor_bytes

        flip = bool(os.environ.get("TOY_WIRE_FLIP"))
        out = []
        for bucket in stream:
            lines = []
            for index, (name, tensor) in enumerate(bucket):
                data = bytearray(tensor_bytes(tensor.cpu()).numpy().tobytes())
                if flip and index == 0 and data:
                    data[0] ^= 1
                shape = ",".join(str(d) for d in tensor.shape)
                lines.append(f"{name} {str(tensor.dtype).split('.')[-1]} {shape} {data.hex()}")
            out.append(HexBucket(tuple(lines)))
        return out

    def decode(self, item, *, engine_rank: int, engine_tp: int, where: str) -> list:
        import torch

        pairs = []
        for index, line in enumerate(item.lines):
            parts = line.split(" ")
            if len(parts) != 4:
                raise WireFormatError(f"{where} line {index}: {len(parts)} fields, not 4")
            name, dtype_name, shape, data = parts
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise WireFormatError(f"{where} line {index}: no dtype {dtype_name!r}")
            dims = tuple(int(d) for d in shape.split(",")) if shape else ()
            raw = bytearray.fromhex(data)
            expected = dtype.itemsize
            for d in dims:
                expected *= d
            if len(raw) != expected:
                raise WireFormatError(f"{where} line {index} {name!r}: {len(raw)} bytes, its "
                                      f"shape {dims} of {dtype} needs {expected}")
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else \
                torch.empty(0, dtype=torch.uint8)
            pairs.append((name, flat.view(dtype).reshape(dims).clone()))
        return pairs


TRANSPORT = HexLines()
