import time, io, pickle, gc
import torch
from pytest_weightsync.reference_impl.sharing.shared_payload import SharedPayload
from pytest_weightsync.reference_impl.sharing import ipc

def main():
    dev = torch.device("cuda")
    torch.cuda.init()
    bufs = [torch.zeros(256 << 20, dtype=torch.bfloat16, device=dev) for _ in range(8)]
    pays = [SharedPayload([(f"a{i}", bufs[i]), (f"b{i}", bufs[i + 1])]) for i in range(0, 8, 2)]
    keep = []
    us = lambda t0: f"{(time.perf_counter() - t0) * 1e6:.0f}"
    for idle in (0.0, 0.005, 0.05):
        for rep in range(4):
            torch.cuda.synchronize(); time.sleep(idle)
            row = []
            for p in pays:
                t0 = time.perf_counter(); keep.append(p.serialize(wait=False)); row.append(us(t0))
            print(f"idle {idle*1e3:4.0f} ms serialize per payload (2 shares) us:", row, flush=True)
    for idle in (0.0, 0.005):
        for rep in range(3):
            torch.cuda.synchronize(); time.sleep(idle)
            row = []
            for b in bufs[:4]:
                t0 = time.perf_counter(); keep.append(b.untyped_storage()._share_cuda_()); row.append(us(t0))
            print(f"idle {idle*1e3:4.0f} ms _share_cuda_ us:", row, flush=True)
    gc.disable()
    for rep in range(3):
        torch.cuda.synchronize(); time.sleep(0.005)
        row = []
        for p in pays:
            t0 = time.perf_counter(); keep.append(p.serialize(wait=False)); row.append(us(t0))
        print("gc off, idle 5 ms serialize us:", row, flush=True)
    gc.enable()
    # spin instead of sleep before the first (a hot core)
    for rep in range(3):
        torch.cuda.synchronize(); t_end = time.perf_counter() + 0.005
        while time.perf_counter() < t_end: pass
        row = []
        for p in pays:
            t0 = time.perf_counter(); keep.append(p.serialize(wait=False)); row.append(us(t0))
        print("spin 5 ms serialize us:", row, flush=True)
    # with a big copy running on the GPU (this context) during the shares
    big = torch.empty(3 << 30, dtype=torch.uint8, device=dev); big2 = torch.empty_like(big)
    for rep in range(3):
        torch.cuda.synchronize(); big2.copy_(big)
        row = []
        for p in pays:
            t0 = time.perf_counter(); keep.append(p.serialize(wait=False)); row.append(us(t0))
        print("during a copy serialize us:", row, flush=True)
    torch.cuda.synchronize()

if __name__ == "__main__":
    main()
