# Does aten::baddbmm.dtype (fp16 operands, fp32 result, alpha = the scale, beta = 0) run on CUDA, how fast, and does it equal bmm's fp32 result times the scale bit for bit?
import torch
a = torch.randn(32, 64, 128, device="cuda").half(); b = torch.randn(32, 128, 4096, device="cuda").half()
s = 128 ** -0.5
ref = torch.bmm(a, b, out_dtype=torch.float32).mul_(s)
try:
    x = torch.baddbmm(torch.zeros((), device="cuda"), a, b, out_dtype=torch.float32, beta=0.0, alpha=s)
    print("baddbmm out_dtype:", x.dtype, "equal to bmm * scale:", torch.equal(x, ref), "max diff", (x - ref).abs().max().item())
except Exception as e:
    print("baddbmm out_dtype failed:", str(e)[:300])
