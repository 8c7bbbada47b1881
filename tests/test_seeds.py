"""The worked numbers of the seed notes (/work/shared/seeds), reproduced with tfm's ops.

Every array below is copied from a note's printed output. Eight-digit prints are compared with
``atol=1e-8``, the four/five-digit (float32 torch) prints of seed 002 with 1e-4. Where a note's
code is wrong, the test reproduces what it printed (to show we read it right) and then shows
where tfm differs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from helpers import assert_scaled_close
from tfmcli.engine import masks, ops

ATOL8 = 1e-8


# ================================================================ seed 000 (default_rng(1000))

X_000 = np.array([
    [0.52138574, 0.60384185, 0.4709418, 0.20324794, 0.52875903, 0.19103628],
    [0.2815456, 0.75368155, 0.55167178, 0.86372208, 0.80537222, 0.24837266],
    [0.18985741, 0.98399558, 0.66999717, 0.28038283, 0.20391323, 0.62506469],
    [0.65260432, 0.89880753, 0.97476378, 0.15393237, 0.69908928, 0.44724145],
])
GAMMA1_000 = np.array([0.01751321, 0.29102491, 0.38123661, 0.32102791, 0.94254467, 0.70266697])
BETA1_000 = np.array([0.13645032, 0.34320907, 0.8119946, 0.148494, 0.05932569, 0.31441663])
MU_000 = np.array([[0.41986877], [0.58406098], [0.49220182], [0.63773979]])
STD_000 = np.array([[0.16222732], [0.24536075], [0.29169464], [0.27570681]])
LN_000 = np.array([
    [0.14740956, 0.6732444, 0.93201697, -0.28017197, 0.6919807, -0.67674215],
    [0.11485756, 0.54439777, 0.76166891, 0.51440018, 0.909485, -0.64693146],
    [0.1182977, 0.83387368, 1.04436808, -0.08462584, -0.87221309, 0.63447171],
    [0.13739453, 0.61878157, 1.27801821, -0.4148424, 0.26905803, -0.17108784],
])
K1_000 = np.array([
    [1.2527992, 1.32075642, 0.93814284],
    [2.05800531, 1.85507023, 1.76608856],
    [1.55996752, 1.63750765, 1.30605614],
    [1.82642607, 1.90086531, 1.51556223],
])
Q1_000 = np.array([
    [1.32297136, 0.92811187, 0.93688803],
    [2.01381787, 1.24562666, 1.68262418],
    [1.59113101, 1.19988588, 1.18424662],
    [1.86500052, 1.57009664, 1.39953962],
])
V1_000 = np.array([
    [1.474291, 1.37938888, 1.13889442],
    [2.47774422, 2.3514763, 1.60251449],
    [1.76324287, 1.86219185, 1.41314099],
    [2.17745369, 2.00985722, 1.87073196],
])
SCORES1_000 = np.array([
    [2.17208522, 3.521272, 2.77544456, 3.23341389],
    [3.31781298, 5.44258637, 4.260161, 4.96289114],
    [2.70726303, 4.38319305, 3.4604225, 4.03088871],
    [3.30426476, 5.324631, 4.21942751, 4.91435768],
])
ATTN1_000 = np.array([
    [0.1044632, 0.40263147, 0.19098488, 0.30192045],
    [0.05841662, 0.48900559, 0.14989702, 0.30268077],
    [0.08180307, 0.43713618, 0.17372511, 0.30733564],
    [0.06233814, 0.47009728, 0.15566966, 0.31189492],
])
ATTN2_000 = np.array([
    [0.13172653, 0.27212327, 0.18301422, 0.41313598],
    [0.09215779, 0.25641916, 0.1529684, 0.49845464],
    [0.12569073, 0.27381841, 0.17754409, 0.42294677],
    [0.09610674, 0.26572722, 0.15079531, 0.48737074],
])
OUTPUT1_000 = np.array([
    [2.14579748, 2.05334122, 1.59889611],
    [2.22113208, 2.11794643, 1.62822912],
    [2.17924186, 2.08196385, 1.6141228],
    [2.21030554, 2.10816218, 1.62778924],
])
OUTPUT2_000 = np.array([
    [1.61703732, 1.08593014, 1.76418502],
    [1.65971009, 1.10975219, 1.7909971],
    [1.62332767, 1.0892788, 1.76939115],
    [1.6566034, 1.10739055, 1.79149989],
])


@pytest.fixture
def seed000():
    """The note's draws from default_rng(1000), in its order."""
    rng = np.random.default_rng(1000)
    X = rng.random((4, 6))
    gamma1 = rng.random(6)
    beta1 = rng.random(6)
    W = {name: rng.random((6, 3)) for name in ("k1", "q1", "v1", "k2", "q2", "v2")}
    return X, gamma1, beta1, W


def test_seed000_draws(seed000):
    X, gamma1, beta1, _ = seed000
    np.testing.assert_allclose(X, X_000, rtol=0, atol=ATOL8)
    np.testing.assert_allclose(gamma1, GAMMA1_000, rtol=0, atol=ATOL8)
    np.testing.assert_allclose(beta1, BETA1_000, rtol=0, atol=ATOL8)
    np.testing.assert_allclose(X.mean(-1, keepdims=True), MU_000, rtol=0, atol=ATOL8)
    np.testing.assert_allclose(X.std(-1, keepdims=True), STD_000, rtol=0, atol=ATOL8)


def test_seed000_layer_norm(seed000):
    # The note divides by (std + 1e-9); tfm by sqrt(var + eps). With a negligible eps the two
    # differ by 1e-9 / std * gamma * |x - mu| / std <= 6.1e-9 here; with the print's 5e-9
    # rounding the largest difference from the printed array is 8.4e-9.
    X, gamma1, beta1, _ = seed000
    out, _ = ops.layer_norm_forward(X, gamma1, beta1, eps=1e-18)
    np.testing.assert_allclose(out, LN_000, rtol=0, atol=ATOL8)
    note = gamma1 * (X - X.mean(-1, keepdims=True)) / (X.std(-1, keepdims=True) + 1e-9) + beta1
    assert np.abs(out - note).max() < 1e-8


def test_seed000_head_1(seed000):
    # The note projects X itself (not the layer-norm output) in cell In [12].
    X, _, _, W = seed000
    K1, Q1, V1 = X @ W["k1"], X @ W["q1"], X @ W["v1"]
    np.testing.assert_allclose(K1, K1_000, rtol=0, atol=ATOL8)
    np.testing.assert_allclose(Q1, Q1_000, rtol=0, atol=ATOL8)
    np.testing.assert_allclose(V1, V1_000, rtol=0, atol=ATOL8)

    scores1 = Q1 @ K1.T / math.sqrt(3)
    np.testing.assert_allclose(scores1, SCORES1_000, rtol=0, atol=ATOL8)
    attn1, _ = ops.softmax_forward(scores1)
    np.testing.assert_allclose(attn1, ATTN1_000, rtol=0, atol=ATOL8)
    np.testing.assert_allclose(attn1 @ V1, OUTPUT1_000, rtol=0, atol=ATOL8)

    everywhere = np.ones((4, 4), dtype=bool)
    context, scores, cache = ops.attention_forward(Q1, K1, V1, everywhere, 1 / math.sqrt(3))
    np.testing.assert_allclose(scores, SCORES1_000, rtol=0, atol=ATOL8)
    np.testing.assert_allclose(cache.pattern, ATTN1_000, rtol=0, atol=ATOL8)
    np.testing.assert_allclose(context, OUTPUT1_000, rtol=0, atol=ATOL8)


def test_seed000_head_2_and_concatenation(seed000):
    X, _, _, W = seed000
    K2, Q2, V2 = X @ W["k2"], X @ W["q2"], X @ W["v2"]
    everywhere = np.ones((4, 4), dtype=bool)
    context2, _, cache = ops.attention_forward(Q2, K2, V2, everywhere, 1 / math.sqrt(3))
    np.testing.assert_allclose(cache.pattern, ATTN2_000, rtol=0, atol=ATOL8)
    np.testing.assert_allclose(context2, OUTPUT2_000, rtol=0, atol=ATOL8)

    # Both heads at once, as tfm lays them out: head h owns columns h*3:(h+1)*3.
    Wq = np.concatenate([W["q1"], W["q2"]], axis=1)
    Wk = np.concatenate([W["k1"], W["k2"]], axis=1)
    Wv = np.concatenate([W["v1"], W["v2"]], axis=1)
    q, k, v = (ops.split_heads((X @ w)[None], 2) for w in (Wq, Wk, Wv))   # (1, 2, 4, 3)
    context, _, _ = ops.attention_forward(q, k, v, everywhere, 1 / math.sqrt(3))
    merged = ops.merge_heads(context)[0]                                # (4, 6)
    np.testing.assert_allclose(merged, np.concatenate([OUTPUT1_000, OUTPUT2_000], axis=1),
                               rtol=0, atol=ATOL8)


# ================================================================ seed 002 (integer example)

X_002 = np.array([[1, 0, 1, 0], [0, 2, 0, 2], [1, 1, 1, 1]], dtype=float)
WQ_002 = np.array([[1, 0, 1], [1, 0, 0], [0, 0, 1], [0, 1, 1]], dtype=float)
WK_002 = np.array([[0, 0, 1], [1, 1, 0], [0, 1, 0], [1, 1, 0]], dtype=float)
WV_002 = np.array([[0, 2, 0], [0, 3, 0], [1, 0, 3], [1, 1, 0]], dtype=float)
Q_002 = np.array([[1, 0, 2], [2, 2, 2], [2, 1, 3]], dtype=float)
K_002 = np.array([[0, 1, 1], [4, 4, 0], [2, 3, 1]], dtype=float)
V_002 = np.array([[1, 2, 3], [2, 8, 0], [2, 6, 3]], dtype=float)
QKT_002 = np.array([[2, 4, 4], [4, 16, 12], [4, 12, 10]], dtype=float)
SOFTMAX_002 = np.array([
    [6.3379e-02, 4.6831e-01, 4.6831e-01],
    [6.0337e-06, 9.8201e-01, 1.7986e-02],
    [2.9539e-04, 8.8054e-01, 1.1917e-01],
])
OUTPUTS_002 = np.array([[1.9366, 6.6831, 1.5951], [2.0000, 7.9640, 0.0540],
                        [1.9997, 7.7599, 0.3584]])


def test_seed002_projections():
    np.testing.assert_array_equal(X_002 @ WQ_002, Q_002)
    np.testing.assert_array_equal(X_002 @ WK_002, K_002)
    np.testing.assert_array_equal(X_002 @ WV_002, V_002)
    np.testing.assert_array_equal(Q_002 @ K_002.T, QKT_002)


def test_seed002_unscaled_softmax_and_outputs():
    # The note's code takes softmax(Q K^T) with no 1/sqrt(d_k), although its formula has one:
    # its printed numbers are reproduced with scale=1.
    everywhere = np.ones((3, 3), dtype=bool)
    context, scores, cache = ops.attention_forward(Q_002, K_002, V_002, everywhere, 1.0)
    np.testing.assert_array_equal(scores, QKT_002)
    np.testing.assert_allclose(cache.pattern, SOFTMAX_002, rtol=1e-4, atol=0)  # 5 digits, float32
    np.testing.assert_allclose(context, OUTPUTS_002, rtol=0, atol=1e-4)
    # The illustration's "approximate" table [[0.0, 0.5, 0.5], ...] and its outputs
    # [[2.0, 7.0, 1.5], ...] are not a rounding of these numbers (0.0634 rounds to 0.1, not 0.0),
    # so they are not reproduced.


def test_seed002_scaled_attention_differs():
    everywhere = np.ones((3, 3), dtype=bool)
    context, _, cache = ops.attention_forward(Q_002, K_002, V_002, everywhere, 1 / math.sqrt(3))
    assert np.abs(cache.pattern - SOFTMAX_002).max() > 0.05
    assert np.abs(context - OUTPUTS_002).max() > 0.1
    # Row 0's scores (2, 4, 4) / sqrt(3): the pattern is computable by hand.
    e = np.exp(np.array([2.0, 4.0, 4.0]) / math.sqrt(3))
    assert_scaled_close(cache.pattern[0], e / e.sum())


# ================================================================ seed 003 (default_rng(4000))

X_003 = np.array([
    [[0.45461138, 0.9079045, 0.22341803, 0.75301023, 0.21061655, 0.28646412],
     [0.9110329, 0.06668155, 0.80997244, 0.44144683, 0.01151965, 0.43382742],
     [0.31255883, 0.80263996, 0.22221152, 0.46048076, 0.05819513, 0.49784596],
     [0.46341809, 0.94756117, 0.88801601, 0.33144693, 0.52629353, 0.91218153]],
    [[0.76991742, 0.84385534, 0.95556605, 0.44375354, 0.79734196, 0.11813618],
     [0.8017991, 0.88149331, 0.6328389, 0.11407255, 0.44154406, 0.5999176],
     [0.43327192, 0.17617901, 0.97017048, 0.99389211, 0.24304429, 0.63569],
     [0.99131382, 0.56461089, 0.35934087, 0.96484629, 0.96325469, 0.93638915]],
])
K_003 = np.array([
    [[1.69827184, 0.48160908, 1.48858585, 1.38148467, 1.43737408, 1.74600031],
     [1.60772674, 0.32969475, 1.77063983, 1.67920765, 1.8350396, 1.99610657],
     [1.4499264, 0.38631034, 1.1907154, 1.21686007, 1.26898723, 1.32295591],
     [2.30724769, 0.65258577, 2.1348966, 2.0128202, 2.17980615, 2.27854297]],
    [[1.99027233, 0.62134838, 2.16243293, 1.54949139, 1.82271898, 2.50898325],
     [1.68489373, 0.5519499, 1.81588932, 1.48378157, 1.66687634, 1.97018777],
     [2.42077915, 0.50127999, 2.18992614, 2.34063848, 2.41344037, 2.47249864],
     [2.40920503, 0.90931833, 2.71140137, 2.66256324, 2.49278744, 2.95386996]],
])
ATTN_003 = np.array([
    [[[1.0, 0.0, 0.0, 0.0],
      [0.497259, 0.502741, 0.0, 0.0],
      [0.38630999, 0.38814851, 0.2255415, 0.0],
      [0.09426586, 0.09705267, 0.03723875, 0.77144272]],
     [[1.0, 0.0, 0.0, 0.0],
      [0.34693574, 0.65306426, 0.0, 0.0],
      [0.29142418, 0.54193152, 0.1666443, 0.0],
      [0.0899694, 0.23432084, 0.03652855, 0.63918121]]],
    [[[1.0, 0.0, 0.0, 0.0],
      [0.71826246, 0.28173754, 0.0, 0.0],
      [0.31298757, 0.11543245, 0.57157997, 0.0],
      [0.07595578, 0.01950134, 0.17093249, 0.7336104]],
     [[1.0, 0.0, 0.0, 0.0],
      [0.69964269, 0.30035731, 0.0, 0.0],
      [0.18943338, 0.09595853, 0.71460809, 0.0],
      [0.04338342, 0.01713654, 0.22646623, 0.71301381]]],
])
CONTEXT_003 = np.array([
    [[[1.05080832, 1.27588609, 1.22999668],
      [1.23416586, 1.02423468, 1.14895823],
      [1.11030788, 1.08004929, 1.1478513],
      [1.25899058, 1.86508876, 1.6742963]],
     [[1.26776215, 1.55038072, 0.97869839],
      [1.17164288, 1.67564328, 0.99319525],
      [1.13542784, 1.59168337, 0.94676382],
      [1.52693039, 1.76236945, 1.28605242]]],
    [[[1.74338133, 1.51769822, 1.55104743],
      [1.59495215, 1.56628126, 1.562557],
      [1.61276753, 1.33791164, 1.38436888],
      [1.89721471, 1.67806444, 1.54865867]],
     [[1.92648624, 2.01224077, 1.79940096],
      [1.80386147, 1.92798053, 1.67884222],
      [1.59286308, 1.95044528, 1.27493744],
      [2.09305153, 2.53408733, 1.60889467]]],
])
X_FFN_003 = np.array([
    [[1.50541969, 2.18379059, 1.45341472, 2.02077238, 1.76099727, 1.26516251],
     [2.14519876, 1.09091623, 1.95893067, 1.61308971, 1.68716294, 1.42702267],
     [1.42286671, 1.88268925, 1.37006282, 1.5959086, 1.6498785, 1.44460978],
     [1.72240867, 2.81264993, 2.56231231, 1.85837732, 2.28866297, 2.19823395]],
    [[2.51329875, 2.36155356, 2.50661348, 2.37023978, 2.80958273, 1.91753714],
     [2.39675126, 2.44777457, 2.1953959, 1.91793403, 2.36952459, 2.27875981],
     [2.04603945, 1.51409064, 2.35453936, 2.58675518, 2.19348957, 1.91062744],
     [2.88852852, 2.24267533, 1.90799955, 3.05789783, 3.49734202, 2.54528382]],
])
X_FFN_N_003 = np.array([
    [[0.08728607, 1.49611494, 0.43019102, 1.02796724, 1.16567207, -0.44679896],
     [0.38439053, 0.27265565, 1.21324143, 0.19498251, 1.0708205, -0.08809221],
     [0.05831561, 1.63169049, 0.26823069, 0.43332582, 1.47760112, -0.0921864],
     [-0.02705926, 1.50409262, 1.19680431, -0.47506848, 1.10098782, 0.20264506]],
    [[0.22957322, 0.83642906, 0.95680305, 0.16323514, 2.43953724, -0.72303876],
     [0.28153162, 1.30890326, 0.59533477, -1.19581726, 1.54246478, 0.29525969],
     [0.15088208, 0.23909581, 1.14500097, 1.35179134, 1.24306595, -0.03463275],
     [0.22983243, 0.5805443, 0.08279414, 0.8062191, 2.48653713, 0.1163327]],
])
DOUT_003 = np.array([
    [[0.07788198, -0.00560083, -0.44371856, 0.38684485, 0.1261935, -0.13216348],
     [0.16143276, 0.03677408, 0.24246872, -0.01143926, -0.14273741, -0.05650211],
     [-0.07538471, 0.03161602, -0.11086203, -0.07365076, 0.12672887, 0.08785918],
     [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]],
    [[0.16217772, 0.03159888, 0.2467916, -0.02172796, -0.1281925, -0.02960269],
     [-0.14111161, 0.07411266, -0.21028277, -0.12922675, 0.26637395, 0.19252851],
     [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
     [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]],
])
DB_EXPAND_003 = np.array([
    0.52807845, 0.02083732, 0.29501652, 0.11307535, 0.23229567, 0.25835789, 0.27487867,
    0.23754832, 0.16420999, -0.00402603, 0.20660631, 0.29427045, 0.26891028, 0.34408056,
    0.29926609, 0.3587176, 0.17531845, 0.18706538, -0.00446159, 0.27200958, 0.21405253,
    0.1533026, 0.51044953, 0.54205255,
])
INV_DERIV_003 = np.array([[0.37182575, 0.74729227, 0.36498962, 0.31950039],
                          [0.17760978, 0.21228267, 0.50770274, 0.24048564]])
DG_003 = np.array([
    [[0.63197095, 0.36020242, 0.3306147, -0.48916015, 0.26164413, -0.24588356],
     [-4.18273278, -1.40989492, -7.14950445, 0.93694935, -6.1487175, 0.62602152],
     [0.42804598, 0.11062142, -0.28801772, -0.207494, 0.07656392, -0.16617078],
     [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]],
    [[-0.8575688, -1.25878385, -1.60860361, 0.2697869, -3.85834904, 1.13645828],
     [0.24002654, -0.62711396, -0.79213968, 0.67046709, -0.85700331, -0.47213077],
     [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
     [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]],
])


@pytest.fixture
def seed003():
    """The note's draws from default_rng(4000), in its order (cells In [11]-[31])."""
    rng = np.random.default_rng(4000)
    draws = {"X": rng.random((2, 4, 6))}
    for name in ("Wk", "Wq", "Wv"):
        draws[name] = rng.random((6, 6))
    draws["W_expand"] = rng.random((6, 24))
    draws["b_expand"] = rng.random(24)
    draws["gamma"] = rng.random(6)
    draws["beta"] = rng.random(6)
    draws["W_shrink"] = rng.random((24, 6))
    draws["b_shrink"] = rng.random(6)
    return draws


def _seed003_attention(d):
    X = d["X"]
    q, k, v = (ops.split_heads(X @ d[w], 2) for w in ("Wq", "Wk", "Wv"))   # (2, 2, 4, 3)
    return ops.attention_forward(q, k, v, masks.causal_mask(4), 1 / math.sqrt(3))


def test_seed003_causal_attention(seed003):
    np.testing.assert_allclose(seed003["X"], X_003, rtol=0, atol=ATOL8)
    np.testing.assert_allclose(seed003["X"] @ seed003["Wk"], K_003, rtol=0, atol=ATOL8)
    # The note masks with -1e9 (and triu(k=1) = hidden); tfm with -inf: the same pattern.
    context, scores, cache = _seed003_attention(seed003)
    np.testing.assert_allclose(cache.pattern, ATTN_003, rtol=0, atol=ATOL8)
    np.testing.assert_array_equal(cache.pattern[..., np.triu_indices(4, 1)[0],
                                                np.triu_indices(4, 1)[1]], 0.0)
    np.testing.assert_allclose(context, CONTEXT_003, rtol=0, atol=ATOL8)


def test_seed003_residual_and_layer_norm(seed003):
    context, _, _ = _seed003_attention(seed003)
    X_FFN = seed003["X"] + ops.merge_heads(context)                     # (2, 4, 6)
    np.testing.assert_allclose(X_FFN, X_FFN_003, rtol=0, atol=ATOL8)
    X_FFN_N, _ = ops.layer_norm_forward(X_FFN, seed003["gamma"], seed003["beta"], eps=1e-5)
    np.testing.assert_allclose(X_FFN_N, X_FFN_N_003, rtol=0, atol=ATOL8)


def _seed003_dghat(d, X_FFN_N):
    """The note's dghat, as its cells In [49] and [59] compute it.

    Its dP is ``(dout * (K > 0)) @ W_shrink^T``: the ReLU mask uses the attention keys K (all
    positive here, so no mask at all), and before the product rather than after, instead of
    ``(dout @ W_shrink^T) * (P > 0)``. The pre-activation P is negative at [1, 1, 9] (-0.103), in
    a row whose dout is not zero, so this dghat is not the true gradient of the note's FFN. It is
    still a fine upstream gradient to push through a layer norm, which is all the test needs.
    """
    K = d["X"] @ d["Wk"]
    dP = (DOUT_003 * (K > 0)) @ d["W_shrink"].T                        # (2, 4, 24)
    return dP, dP @ d["W_expand"].T                                     # (2, 4, 6)


def test_seed003_note_dg_reproduces_and_is_wrong(seed003):
    context, _, _ = _seed003_attention(seed003)
    X_FFN = seed003["X"] + ops.merge_heads(context)
    gamma, beta = seed003["gamma"], seed003["beta"]
    X_FFN_N, cache = ops.layer_norm_forward(X_FFN, gamma, beta, eps=1e-5)
    dP, dghat = _seed003_dghat(seed003, X_FFN_N)
    np.testing.assert_allclose(dP.sum((0, 1)), DB_EXPAND_003, rtol=0, atol=ATOL8)

    # The note's dg (In [60]-[64]), literally: this is the printed array, so dghat is the same.
    d = 6
    sum_dghat = np.sum(dghat, axis=-1, keepdims=True)
    sum_dghat_ghat = np.sum(sum_dghat, axis=-1, keepdims=True)   # meant: sum(dghat * ghat)
    sigma = np.std(X_FFN_N, axis=-1, keepdims=True)              # the output's std
    inv_deriv = 1 / (d * (sigma**2 + 1e-5))
    np.testing.assert_allclose(inv_deriv[..., 0], INV_DERIV_003, rtol=0, atol=ATOL8)
    dg_note = inv_deriv * (d * dghat - sum_dghat - X_FFN_N * sum_dghat_ghat)
    np.testing.assert_allclose(dg_note, DG_003, rtol=0, atol=ATOL8)

    # tfm's layer-norm backward on the same dghat ...
    dg_ours, _, _ = ops.layer_norm_backward(dghat, cache)
    assert np.abs(dg_ours - DG_003).max() > 1.0

    # ... agrees with central differences of (LN(X_FFN) * dghat).sum(); the note's does not.
    x = X_FFN.copy()
    numeric = np.zeros_like(x)
    h = 1e-6
    for i in np.ndindex(x.shape):
        original = x[i]
        x[i] = original + h
        plus = (ops.layer_norm_forward(x, gamma, beta, 1e-5)[0] * dghat).sum()
        x[i] = original - h
        minus = (ops.layer_norm_forward(x, gamma, beta, 1e-5)[0] * dghat).sum()
        x[i] = original
        numeric[i] = (plus - minus) / (2 * h)
    scale = np.abs(numeric).max()
    assert np.abs(dg_ours - numeric).max() / scale <= 1e-7
    assert np.abs(DG_003 - numeric).max() / scale > 0.5
    # Rows with dout = 0 (positions past each row's length) have zero gradient either way.
    np.testing.assert_array_equal(dg_ours[0, 3], 0.0)
    np.testing.assert_array_equal(dg_ours[1, 2:], 0.0)


# ================================================================ seed 004 (3 x 7 x 7 mask)

_T, _F = True, False   # short names so the literals keep the note's layout
TRG_PAD_MASK_004 = np.array([[[_T, _T, _T, _T, _F, _F, _F]],
                             [[_T, _T, _F, _F, _F, _F, _F]],
                             [[_T, _T, _T, _T, _T, _T, _F]]])
TRG_MASK_004 = np.array([
    [[_T, _F, _F, _F, _F, _F, _F],
     [_T, _T, _F, _F, _F, _F, _F],
     [_T, _T, _T, _F, _F, _F, _F],
     [_T, _T, _T, _T, _F, _F, _F],
     [_T, _T, _T, _T, _F, _F, _F],
     [_T, _T, _T, _T, _F, _F, _F],
     [_T, _T, _T, _T, _F, _F, _F]],

    [[_T, _F, _F, _F, _F, _F, _F],
     [_T, _T, _F, _F, _F, _F, _F],
     [_T, _T, _F, _F, _F, _F, _F],
     [_T, _T, _F, _F, _F, _F, _F],
     [_T, _T, _F, _F, _F, _F, _F],
     [_T, _T, _F, _F, _F, _F, _F],
     [_T, _T, _F, _F, _F, _F, _F]],

    [[_T, _F, _F, _F, _F, _F, _F],
     [_T, _T, _F, _F, _F, _F, _F],
     [_T, _T, _T, _F, _F, _F, _F],
     [_T, _T, _T, _T, _F, _F, _F],
     [_T, _T, _T, _T, _T, _F, _F],
     [_T, _T, _T, _T, _T, _T, _F],
     [_T, _T, _T, _T, _T, _T, _F]],
])


def test_seed004_padding_mask():
    mask = masks.padding_mask([4, 2, 6], 7)
    assert mask.shape == (3, 7)
    np.testing.assert_array_equal(mask, TRG_PAD_MASK_004[:, 0, :])


def test_seed004_combined_mask():
    mask = masks.combined_mask([4, 2, 6], 7, causal=True)
    assert mask.shape == (3, 7, 7) and mask.dtype == bool
    np.testing.assert_array_equal(mask, TRG_MASK_004)
    np.testing.assert_array_equal(mask, TRG_PAD_MASK_004 & masks.causal_mask(7)[None])
