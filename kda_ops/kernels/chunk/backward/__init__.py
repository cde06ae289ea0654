"""Chunkwise KDA / Gated DeltaNet backward in six kernels, from the chunk-start states the
training forward's recurrence kernel keeps (or, when nothing was kept, that kernel run
here on kernel 1's intermediates). Each kernel and its launch is a module of this
package; ``launch.py`` runs them in order.

Notation per chunk of C = 64 tokens and value head (as in the forward, ``chunk/``): q̂, k̂
the (l2-normalised) rows, β, in-chunk cumulative log-decay G (Γ = exp(G), Γ_C its last
row), ``A = tril(β (K̂ ⊙ Γ)(K̂ / Γ)ᵀ, -1)``, ``T = (I + A)⁻¹``, ``w = T β (K̂ ⊙ Γ)``,
``u = T β V``, ``qg = scale Q̂ ⊙ Γ``, ``kd = K̂ ⊙ Γ_C / Γ``,
``Aqk = scale tril((Q̂ ⊙ Γ)(K̂ / Γ)ᵀ)``; with S the state entering the chunk,
``v_new = u - w S``, ``O = qg S + Aqk v_new``, ``S' = diag(Γ_C) S + kdᵀ v_new``.

1. ``prepare.py``: ``chunk_bwd_prepare_kernel``, the forward's prepare with what the
   backward also reads (G, T, the rows' inverse norms); ``recompute.py`` rebuilds the
   rows G, w, qg, kd from the inputs and T when the forward kept all but them.
2. ``state.py``: ``chunk_bwd_state_kernel``, the reverse scan over the chunks carrying dS.
3. ``wy.py``: ``chunk_bwd_wy_kernel``, everything that goes through S, dS' and T.
4. ``pairs.py``: ``chunk_bwd_pairs_kernel``, the pair terms of A and Aqk by 16-row blocks.
   Not for the scalar (Gated DeltaNet) gate: one decay a row scales whole entries of the
   ``[C, C]`` matrices (E_ij = e^{G_i - G_j}), so its pair terms are plain products that
   kernel 3 takes in its key loop, and G, dG are one a row (``[B, T, HV]``), not K wide.
5. ``gate.py``: ``chunk_bwd_gate_kernel``, the gate's backward and dβ.
6. ``qk.py``: ``chunk_bwd_qk_kernel``, dq and dk through the l2norm.

``saved.py`` holds what the training forward keeps (``SavedForBackward``), ``layout.py``
the sizes and flags every launch shares, ``rows.py`` the device functions that load a
chunk's rows as the forward saw them.

Saved versus recomputed: the training forward's recurrence writes the chunk states S (q's
dtype; 0.27 GB in bf16 at T = 8192, 64 heads, K = V = 128) as it goes, and the forward
keeps them: writing them costs the forward a fraction of what running that
head-parallel scan again would cost the backward.
Kernel 1's outputs are made once, not per value block (kernel 2 reads them serially per
chunk, kernel 3 needs T, and recomputing them per value block would repeat the O(C² K)
work): by the training forward, which keeps Aqk and T (fp32; about 0.28 GB at that shape)
and, with ``disable_recompute``, G, w, u, qg, kd too (1.4 GB with the states); by the backward
itself when nothing was kept (``kda::chunk``'s own autograd, when that op is called
directly), which then also runs the recurrence for S.

Numerics: accumulation is fp32; products with S / dS, dO and v_new use the input dtype
(bf16 tensor cores), products with T use fp32 operands (tf32). How the pair factors stay
at most 1 is in ``pairs.py``.
"""
