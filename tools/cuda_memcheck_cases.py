"""Every CUDA op on a small grid, for `compute-sanitizer --tool memcheck` (see tools/gpu_check.sh):

    compute-sanitizer --tool memcheck python -m tools.cuda_memcheck_cases

Covers each kernel path once or twice: the fused, cluster (2 and 4 blocks per head), tensor-core
and cuBLAS encoders (alone and as a pair), sign-and-pack, Hamming scores, the one-launch (also in
grid slices), chunked and radix-select paths of hamming_topk, topk_from_scores, sparse_attention
with one and with several splits (merged in a cluster and through the counters, from a memset or
from the caller's workspace), HF and paged layouts, with counts and without, and with a NaN query
and infinite values. Results are compared with the CPU kernels, so the run also fails on wrong
answers. Prints OK at the end.

Kernel paths that the automatic choices would not take at these sizes are forced with the timing
aids ``HASHATTENTION_ENCODER``, ``HASHATTENTION_SELECTION_RESIDENT_BLOCKS`` and
``HASHATTENTION_ATTENTION_CLUSTER``.
"""

import argparse
import os

import torch

import hashattention as ha


def signatures(shape, g):
    return torch.randint(-(2**31), 2**31, shape, generator=g, dtype=torch.int64).to(torch.int32)


def bit_agreement(a, b):
    """Share of equal bits between two int32 signature tensors of one shape."""
    differing = (a ^ b).view(torch.uint8).unsqueeze(-1).bitwise_and(1 << torch.arange(8, dtype=torch.uint8)) != 0
    return 1.0 - differing.float().mean().item()


def main(argv=None):
    argparse.ArgumentParser(prog="python -m tools.cuda_memcheck_cases",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    if not (torch.cuda.is_available() and ha.WITH_CUDA):
        raise SystemExit("tools.cuda_memcheck_cases needs a GPU and the extension built with its CUDA kernels")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 64, generator=g)
    weights = [torch.randn(3, 64, 32, generator=g), torch.randn(3, 32, 64, generator=g)]
    biases = [torch.randn(3, 32, generator=g), torch.randn(3, 64, generator=g)]
    ha.encode_signatures(x.cuda(), [w.cuda() for w in weights], [b.cuda() for b in biases])  # fused (10 rows)
    x_long = torch.randn(2, 3, 40, 64, generator=g)  # 80 rows per head: the cuBLAS path
    ha.encode_signatures(x_long.cuda(), [w.cuda() for w in weights], [b.cuda() for b in biases])
    # encode_signatures_pair: one fused launch for both problems (the key's 1 head read by all 3
    # MLP heads, more key rows than query rows), then a cuBLAS key beside a fused query.
    cuda = lambda ts: [t.cuda() for t in ts]  # noqa: E731
    for key in (torch.randn(2, 1, 7, 64, generator=g), torch.randn(2, 1, 40, 64, generator=g)):
        query = x[:, :, :1]
        got = ha.encode_signatures_pair(query.cuda(), cuda(weights), cuda(biases), key.cuda(), cuda(weights), cuda(biases))
        expected = ha.encode_signatures_pair(query, weights, biases, key, weights, biases)
        assert got[0].shape == expected[0].shape and got[1].shape == expected[1].shape, "encode_signatures_pair"
    # Half-precision decode rows: the cluster kernel (up to 4 rows per head, power-of-two widths;
    # 2 and 4 blocks per head) and the tensor-core kernel (bf16 weights, 5-16 rows per head).
    # Against the float32 CPU encoder: half-precision sums may flip a sign that sits near zero.
    half_weights = [w.to(torch.bfloat16) for w in weights]
    half_biases = [b.to(torch.bfloat16) for b in biases]
    for rows, encoder in ((1, None), (2, "cluster4"), (4, None)):
        x_half = torch.randn(2, 3, rows, 64, generator=g).to(torch.bfloat16)
        expected = ha.encode_signatures(x_half.float(), [w.float() for w in half_weights], [b.float() for b in half_biases])
        if encoder is not None:
            os.environ["HASHATTENTION_ENCODER"] = encoder
        try:
            got = ha.encode_signatures(x_half.cuda(), cuda(half_weights), cuda(half_biases)).cpu()
        finally:
            os.environ.pop("HASHATTENTION_ENCODER", None)
        assert bit_agreement(got, expected) > 0.97, f"encode_signatures bf16 rows={rows}"
    values = torch.randn(7, 96, generator=g)
    assert torch.equal(ha.pack_signs(values.cuda()).cpu(), ha.pack_signs(values))

    # (1, 4, 4, 4, 4096): the one-launch path with one query head per selection head;
    # (1, 8, 2, 2, 3000): the same path with groups of 4 and per-KV-head keys.
    for words, hq, hk, hs, keys in ((1, 4, 4, 4, 4096), (1, 8, 2, 2, 3000), (2, 4, 4, 4, 700), (32, 4, 4, 1, 300)):
        q_sig, k_sig = signatures((2, hq, 3, words), g), signatures((2, hk, keys, words), g)
        assert torch.equal(ha.hamming_scores(q_sig.cuda(), k_sig.cuda(), hs).cpu(), ha.hamming_scores(q_sig, k_sig, hs))
        lengths = torch.tensor([keys, keys // 3], dtype=torch.int32)
        starts = torch.tensor([0, 5], dtype=torch.int32)
        kwargs = dict(selection_heads=hs, sink_tokens=4, local_tokens=8, budget_tokens=keys // 5)
        got = ha.hamming_topk(q_sig.cuda(), k_sig.cuda(), lengths=lengths.cuda(), start_positions=starts.cuda(), **kwargs)
        expected = ha.hamming_topk(q_sig, k_sig, lengths=lengths, start_positions=starts, **kwargs)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, expected)), f"hamming_topk W={words}"
    # Grid slices of the one-launch path: a grid of at most 4 resident blocks forces launches of
    # 4 head rows (24 rows of one 4096-position block each).
    os.environ["HASHATTENTION_SELECTION_RESIDENT_BLOCKS"] = "4"
    try:
        q_sig, k_sig = signatures((2, 4, 3, 1), g), signatures((2, 4, 4096, 1), g)
        kwargs = dict(selection_heads=4, sink_tokens=4, local_tokens=8, budget_tokens=700)
        got = ha.hamming_topk(q_sig.cuda(), k_sig.cuda(), **kwargs)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, ha.hamming_topk(q_sig, k_sig, **kwargs))), "grid slices"
    finally:
        del os.environ["HASHATTENTION_SELECTION_RESIDENT_BLOCKS"]

    scores = torch.randn(2, 3, 2, 900, generator=g)
    got = ha.topk_from_scores(scores.cuda(), sink_tokens=3, local_tokens=3, budget_tokens=100)
    expected = ha.topk_from_scores(scores, sink_tokens=3, local_tokens=3, budget_tokens=100)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, expected)), "topk_from_scores"

    # Both merges of the attention's splits: in a thread-block cluster (the default where the splits
    # fit one) and through the counters (HASHATTENTION_ATTENTION_CLUSTER=0).
    for cluster in (None, "0"):
        if cluster is None:
            os.environ.pop("HASHATTENTION_ATTENTION_CLUSTER", None)
        else:
            os.environ["HASHATTENTION_ATTENTION_CLUSTER"] = cluster
        for dtype, head_dim, width in ((torch.bfloat16, 128, 40), (torch.float16, 64, 3000), (torch.float32, 256, 300)):
            q = torch.randn(2, 8, 2, head_dim, generator=g).to(dtype)
            k = torch.randn(2, 2, 4000, head_dim, generator=g).to(dtype)
            v = torch.randn(2, 2, 4000, head_dim, generator=g).to(dtype)
            for hs in (8, 2):
                indices = torch.randint(-1, 4000, (2, hs, 2, width), generator=g, dtype=torch.int32)
                counts = torch.randint(0, width + 1, (2, hs, 2), generator=g, dtype=torch.int32)
                clean = torch.where(torch.arange(width) < counts[..., None], indices.clamp(min=0), -1).to(torch.int32)
                out, lse = ha.sparse_attention(q.cuda(), k.cuda(), v.cuda(), clean.cuda(), counts.cuda(), scale=0.1)
                ref, ref_lse = ha.sparse_attention(q, k, v, clean, counts, scale=0.1)
                assert torch.allclose(out.cpu().float(), ref.float(), atol=3e-2, rtol=3e-2), f"attention {dtype}"
                ha.sparse_attention(q.cuda(), k.cuda(), v.cuda(), indices.cuda(), scale=0.1)  # no counts, -1 skipped
                # Non-finite inputs through the same merges: a NaN query element (its row is NaN) and an
                # infinite value column in sequence 1 (inf in that column of every non-empty row).
                q_bad, v_bad = q.clone(), v.clone()
                q_bad[0, 1, 0, 3] = float("nan")
                v_bad[1, :, :, 5] = float("inf")
                out, lse = ha.sparse_attention(q_bad.cuda(), k.cuda(), v_bad.cuda(), clean.cuda(), counts.cuda(),
                                               scale=0.1)
                ref, ref_lse = ha.sparse_attention(q_bad, k, v_bad, clean, counts, scale=0.1)
                torch.testing.assert_close(out.cpu().float(), ref.float(), atol=3e-2, rtol=3e-2, equal_nan=True,
                                           msg=lambda m: f"non-finite attention {dtype}: {m}")
                torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-3, rtol=1e-3, equal_nan=True,
                                           msg=lambda m: f"non-finite attention lse {dtype}: {m}")
            # paged
            pages = torch.randperm(64, generator=g)[:2 * 32].view(2, 32).to(torch.int32)
            kp = torch.randn(64, 16, 2, head_dim, generator=g).to(dtype)
            vp = torch.randn(64, 16, 2, head_dim, generator=g).to(dtype)
            indices = torch.randint(0, 512, (2, 2, 2, width), generator=g, dtype=torch.int32)
            out, _ = ha.sparse_attention(q.cuda(), kp.cuda(), vp.cuda(), indices.cuda(), scale=0.1,
                                         block_table=pages.cuda())
            ref, _ = ha.sparse_attention(q, kp, vp, indices, scale=0.1, block_table=pages)
            assert torch.allclose(out.cpu().float(), ref.float(), atol=3e-2, rtol=3e-2), f"paged {dtype}"
    os.environ.pop("HASHATTENTION_ATTENTION_CLUSTER", None)

    # The counters' merge from a caller-owned workspace (no memset; the last split of each unit
    # resets its counter, so the workspace must come back zeroed), with the cluster merge off.
    os.environ["HASHATTENTION_ATTENTION_CLUSTER"] = "0"
    try:
        q = torch.randn(2, 8, 1, 128, generator=g).to(torch.bfloat16)
        k = torch.randn(2, 2, 6000, 128, generator=g).to(torch.bfloat16)
        v = torch.randn(2, 2, 6000, 128, generator=g).to(torch.bfloat16)
        indices = torch.sort(torch.randperm(6000, generator=g)[:2000]).values.to(torch.int32).expand(2, 8, 1, 2000)
        workspace = torch.zeros(2 * 8 * 1, dtype=torch.int32, device="cuda")
        for _ in range(2):
            out, _ = ha.sparse_attention(q.cuda(), k.cuda(), v.cuda(), indices.contiguous().cuda(), scale=0.1,
                                         workspace=workspace)
        ref, _ = ha.sparse_attention(q, k, v, indices.contiguous(), scale=0.1)
        assert torch.allclose(out.cpu().float(), ref.float(), atol=3e-2, rtol=3e-2), "attention with workspace"
        assert int(workspace.abs().sum()) == 0, "the workspace came back non-zero"
    finally:
        os.environ.pop("HASHATTENTION_ATTENTION_CLUSTER", None)
    torch.cuda.synchronize()
    print("OK")


if __name__ == "__main__":
    main()
