"""tacl_jax.isotropy's per-layer measures against naive numpy loops on random states."""

import numpy as np
import pytest

from tacl_jax import isotropy


def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _naive(hs, hm, ht, mask, anchors, tau):
    """One layer, loops over rows and pairs."""
    pair = apair = 0.0
    npair = napair = 0
    toks, tcos, acos, na = [], 0.0, 0.0, 0
    for b in range(hs.shape[0]):
        real = [i for i in range(hs.shape[1]) if mask[b, i]]
        anc = [i for i in real if anchors[b, i]]
        us, um, ut = _unit(hs[b]), _unit(hm[b]), _unit(ht[b])
        for n, (lst, u) in enumerate(((real, us), (anc, um))):
            for x in range(len(lst)):
                for y in range(x + 1, len(lst)):
                    c = float(u[lst[x]] @ u[lst[y]])
                    if n == 0:
                        pair, npair = pair + c, npair + 1
                    else:
                        apair, napair = apair + c, napair + 1
        for i in real:
            toks.append(us[i])
            tcos += float(us[i] @ ut[i])
        for i in anc:
            acos += float(um[i] @ ut[i])
            na += 1
    t = np.stack(toks)
    c = t.sum(0) / np.linalg.norm(t.sum(0))
    taus = (tau,) + isotropy.TAU_GRID
    nll = {(name, k): 0.0 for name in ("plain", "dc") for k in range(len(taus))}
    for b in range(hs.shape[0]):
        real = [j for j in range(hs.shape[1]) if mask[b, j]]
        ut = _unit(ht[b])
        for i in real:
            if not anchors[b, i]:
                continue
            u = _unit(hm[b, i])
            for vec, name in ((u, "plain"), (_unit(u - (u @ c) * c), "dc")):
                for k, temp in enumerate(taus):
                    sc = np.array([vec @ ut[j] for j in real]) / temp
                    nll[name, k] += np.log(np.exp(sc - sc.max()).sum()) + sc.max() - sc[real.index(i)]
    cov = np.cov(t.T, bias=True)
    ev = np.linalg.eigvalsh(cov)
    mean = t.mean(0)
    return dict(self_similarity=pair / npair, masked_anchor_self_similarity=apair / napair,
                top_pc_share=ev[-1] / ev.sum(), mean_norm_sq=float(mean @ mean),
                cosine_to_teacher=tcos / len(toks), anchor_cosine_to_teacher=acos / na,
                anchor_tacl_loss=nll["plain", 0] / na, anchor_tacl_loss_decommon=nll["dc", 0] / na,
                anchor_tacl_loss_by_tau=[nll["plain", k] / na for k in range(1, len(taus))],
                anchor_tacl_loss_decommon_by_tau=[nll["dc", k] / na for k in range(1, len(taus))])


def test_measures_match_naive_loops():
    rng = np.random.default_rng(0)
    b, length, h, layers = 3, 7, 5, 2
    common = rng.normal(size=h) * 2.0              # a shared direction: anisotropic states
    hs = [rng.normal(size=(b, length, h)) + common for _ in range(layers)]
    hm = [x + rng.normal(size=x.shape) * 0.5 for x in hs]
    ht = [x + rng.normal(size=x.shape) * 0.3 for x in hs]
    mask = np.ones((b, length), np.int32)
    mask[1, 5:] = 0
    mask[2, 3:] = 0
    anchors = (rng.uniform(size=(b, length)) < 0.5).astype(np.int32)
    anchors[:, 0] = 1
    anchors[0, 1] = 1
    anchors[1, 1:3] = 1
    sums = isotropy.batch_sums([x.astype(np.float32) for x in hs], [x.astype(np.float32) for x in hm],
                               [x.astype(np.float32) for x in ht], mask, anchors, temperature=0.2)
    got = isotropy.finish({k: np.asarray(v, np.float64) for k, v in sums.items()})
    for layer in range(layers):
        want = _naive(hs[layer], hm[layer], ht[layer], mask, anchors * mask, 0.2)
        for k, v in want.items():
            if k.startswith("anchor_tacl_loss"):          # the last layer only
                if layer == layers - 1:
                    assert got[k] == pytest.approx(v, rel=1e-4), k
                continue
            assert got[k][layer] == pytest.approx(v, abs=2e-5), (k, layer)
    assert got["anchor_tacl_loss_decommon"] != pytest.approx(got["anchor_tacl_loss"], rel=1e-3)


@pytest.mark.slow
def test_sums_add_over_batches():
    """Measures of two batches' added sums equal those of the concatenated batch."""
    rng = np.random.default_rng(1)
    hs, hm, ht = ([rng.normal(size=(4, 6, 3)).astype(np.float32)] for _ in range(3))
    mask = np.ones((4, 6), np.int32)
    anchors = np.zeros((4, 6), np.int32)
    anchors[:, 1:3] = 1
    whole = isotropy.finish({k: np.asarray(v, np.float64)
                             for k, v in isotropy.batch_sums(hs, hm, ht, mask, anchors).items()})
    parts = [isotropy.batch_sums([hs[0][s]], [hm[0][s]], [ht[0][s]], mask[s], anchors[s])
             for s in (slice(0, 1), slice(1, 4))]
    added = isotropy.finish({k: np.asarray(parts[0][k], np.float64) + np.asarray(parts[1][k], np.float64)
                             for k in parts[0]})
    for k in whole:
        if not k.startswith("anchor_tacl_loss_decommon"):       # its common direction is each batch's own
            assert added[k] == pytest.approx(whole[k], rel=1e-5, abs=1e-5), k
