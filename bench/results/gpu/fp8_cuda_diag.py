"""Where FP8 quantization on CUDA differs from the host's (2026-12-06 night): codes or scales, and which values."""
import sys
sys.path.insert(0, "tests")
import numpy as np
import torch
from dfcache import fp8
from test_fp8 import _states

bits = _states(n=2048, h=4096, seed=0)
t = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
dev = fp8.quantize_torch(t.cuda()).cpu().numpy()
host = fp8.quantize(bits)
cpu_t = fp8.quantize_torch(t).numpy()
h = 4096
print("torch cpu == numpy host:", np.array_equal(cpu_t, host))
d = dev != host
print("code bytes differ:", int(d[:, :h].sum()), "scale bytes differ:", int(d[:, h:].sum()))
f = (bits.astype(np.uint32) << 16).view(np.float32)
sc_h = host[:, h:].copy().view("<f4").reshape(-1)
sc_d = dev[:, h:].copy().view("<f4").reshape(-1)
print("scale rows differ:", int((sc_h != sc_d).sum()))
rows, cols = np.nonzero(d[:, :h])
for r, c in list(zip(rows, cols))[:12]:
    q = np.float32(f[r, c]) / sc_h[r]
    qd = (torch.tensor(f[r, c], device="cuda") / torch.tensor(sc_h[r], device="cuda")).item()
    print(f"row {r} col {c}: x={f[r, c]!r} scale={sc_h[r]!r} x/scale host={q!r} cuda={qd!r} code host={host[r, c]:#04x} dev={dev[r, c]:#04x}")
# the cast alone: same float32 inputs on both sides
x = torch.from_numpy((f / sc_h[:, None]).astype(np.float32))
c_cpu = x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
c_dev = x.cuda().to(torch.float8_e4m3fn).view(torch.uint8).cpu().numpy()
print("cast alone differs (torch cpu vs cuda):", int((c_cpu != c_dev).sum()))
q_dev = (torch.from_numpy(f).cuda() / torch.from_numpy(sc_h).cuda()[:, None]).cpu().numpy()
print("division differs (numpy vs cuda):", int((q_dev != (f / sc_h[:, None])).sum()))
