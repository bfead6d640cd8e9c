"""Eviction rules beyond ROUTE_KNN on ``mixtral-realistic``: the search behind ``Eviction.ROUTE_LFU``.

A NumPy simulator of the cache's global pool under policy ``full`` (every miss fetched, misses
in RECENCY fetch order, free slots first in ``(usage, slot)``, the call's own experts never
victims) in which a *rule* ranks the residents (ascending key = evicted first; ties by
``(usage, slot)``). It reproduces the library's ``lru``, ``route_knn`` and ``route_lfu`` hit
rates exactly (``--check`` compares with :func:`pallas_cache.sizing.sweep.replay`). Rules read
the same history as ROUTE_KNN (the ring of per-token per-layer routes and the similarity sums);
the ``oracle_*`` rules also read the future, to bound what a kind of information can give.
Prints, per rule, the mean hit rate at S = 64 / 128 / 192, the share of the LRU -> Belady gap
and the worst difference to LRU (``benchmarks/RESULTS.md``, section ``route_rules``).

    python benchmarks/route_rules_explore.py [--seeds 0 1] [--tokens 1000] [--rules NAME ...]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from pallas_cache.sizing.synthetic import synthetic_trace  # noqa: E402

W = 128


class Ctx:
    """What a rule may read: the token history, similarities, the call."""


def simulate(dense, S, rule, *, W=W, K=3):
    N, L, _ = dense.shape
    E = int(dense.max()) + 1 if dense.size else 1
    E = max(E, 8)
    R = np.zeros((N + 1, L, E), bool)
    sim = np.zeros(N + 1, np.int64)
    id_of_slot = np.full(S, -1, np.int64)
    usage = np.zeros(S, np.int64)
    slot_for = np.full(L * E, -1, np.int64)
    step = 0
    hits = active = 0
    H = -(-S // L)
    ctx = Ctx()
    ctx.L, ctx.E, ctx.S, ctx.H, ctx.K, ctx.R, ctx.W = L, E, S, H, K, R, W
    ctx.last_use_call = np.full(L * E, -1, np.int64)  # step of last route, by flat id
    layers = np.arange(L)
    for T in range(N):
        if T >= 1:
            lo = max(1, T - W + 2)
            sim[:] = 0
            if lo <= T - 1:
                sim[lo:T] = (R[lo - 1:T - 1] & R[T - 1][None]).sum((1, 2))
        for l in range(L):
            step += 1
            D = sorted({int(e) for e in dense[T, l] if e >= 0})
            b = np.zeros(E, bool)
            b[D] = True
            R[T, l] = b
            lo = max(0, T - W + 1)
            if lo < T:
                sim[lo:T] += 2 * (R[lo:T, l] & b[None]).sum(1)
            misses = []
            for e in D:
                s = slot_for[l * E + e]
                if s >= 0:
                    usage[s] = step
                    hits += 1
                else:
                    misses.append(e)
            # Fetch order RECENCY: descending recency before this call, ties to the lower id.
            misses.sort(key=lambda e: (-ctx.last_use_call[l * E + e], e))
            for e in D:
                ctx.last_use_call[l * E + e] = step
            active += len(D)
            if misses:
                evictable = usage != step
                free = evictable & (id_of_slot < 0)
                occ = evictable & (id_of_slot >= 0)
                fs = np.flatnonzero(free)
                fs = fs[np.lexsort((fs, usage[fs]))]
                victims = list(fs[:len(misses)])
                need = len(misses) - len(victims)
                if need > 0:
                    os_ = np.flatnonzero(occ)
                    ctx.T, ctx.l, ctx.step, ctx.sim, ctx.D = T, l, step, sim, D
                    key = rule(ctx, id_of_slot[os_], usage[os_])
                    if key is None:
                        order = np.lexsort((os_, usage[os_]))
                    elif isinstance(key, tuple):
                        order = np.lexsort((os_, usage[os_]) + tuple(reversed(key)))
                    else:
                        order = np.lexsort((os_, usage[os_], key))
                    victims += list(os_[order[:need]])
                for e, v in zip(misses, victims):
                    old = id_of_slot[v]
                    if old >= 0:
                        slot_for[old] = -1
                    id_of_slot[v] = l * E + e
                    slot_for[l * E + e] = v
                    usage[v] = step
    return hits / active


# ---------------------------------------------------------------- helpers for rules

def neighbours(ctx, K=None):
    K = ctx.K if K is None else K
    T = ctx.T
    lo = max(0, T - ctx.W + 1)
    past = np.arange(lo, T)
    if past.size == 0:
        return past
    order = np.lexsort((-past, -ctx.sim[past]))
    return past[order[:K]]


def first_k(ctx, nb, H):
    """k_j [K, L, E]: smallest k < H with e in R[j + k + shift, m], seen only; else H."""
    L, T, l = ctx.L, ctx.T, ctx.l
    shift = (np.arange(L) <= l).astype(np.int64)
    k = np.arange(H)
    tok = nb[:, None, None] + k[None, :, None] + shift[None, None, :]  # [K,H,L]
    seen = k[None, :] <= (T - 1 - nb)[:, None]  # [K,H]
    tokc = np.minimum(tok, T)
    bits = ctx.R[tokc, np.arange(L)[None, None, :]]  # [K,H,L,E]
    bits = bits & seen[:, :, None, None]
    return np.where(bits, k[None, :, None, None], H).min(1)  # [K,L,E]


def dist(ctx):
    L, l = ctx.L, ctx.l
    return (np.arange(L) - l - 1) % L + 1


def route_knn(ctx, occ_ids, occ_usage):
    nb = neighbours(ctx)
    if nb.size == 0:
        return None
    kj = first_k(ctx, nb, ctx.H)
    NU = len(nb) * dist(ctx)[:, None] + ctx.L * kj.sum(0)
    return -NU.reshape(-1)[occ_ids]


def lru(ctx, occ_ids, occ_usage):
    return None


# ---------------------------------------------------------------- exploration harness

_CACHE = {}


def baseline(seed, tokens=1000):
    import json
    from pallas_cache.sizing.bounds import belady
    import hashlib
    from pallas_cache.sizing.synthetic import PRESETS
    preset = hashlib.sha1(repr(PRESETS["mixtral-realistic"]).encode()).hexdigest()[:12]
    path = f"/tmp/knn_base_{preset}_{seed}_{tokens}.json"  # other knobs miss the cache
    if os.path.exists(path):
        return json.load(open(path))
    tr = synthetic_trace("mixtral-realistic", num_tokens=tokens, seed=seed)
    dense = tr.to_dense()
    out = {"lru": [simulate(dense, S, lru) for S in (64, 128, 192)],
           "belady": [belady(tr, S).hit_rate for S in (64, 128, 192)]}
    json.dump(out, open(path, "w"))
    return out


def dense_of(seed, tokens=1000):
    if (seed, tokens) not in _CACHE:
        _CACHE[seed, tokens] = synthetic_trace("mixtral-realistic", num_tokens=tokens,
                                               seed=seed).to_dense()
    return _CACHE[seed, tokens]


def evaluate(name, rule, seeds=(0, 1), tokens=1000, sizes=(64, 128, 192), W=W):
    t0 = time.time()
    rates = []
    for s in seeds:
        dense = dense_of(s, tokens)
        if getattr(rule, "needs_future", False):
            rule.future = routed_bits(dense)
        rates.append([simulate(dense, S, rule, W=W) for S in sizes])
    rates = np.array(rates)
    base = [baseline(s, tokens) for s in seeds]
    lru_ = np.array([b["lru"] for b in base]).mean(0)
    bel = np.array([b["belady"] for b in base]).mean(0)
    mean = rates.mean(0)
    share = (mean - lru_) / (bel - lru_)
    print(f"{name:40s} " + " ".join(f"{v:.4f}" for v in mean) + " | share "
          + " ".join(f"{v:+.2f}" for v in share) + f" | -lru {min(mean - lru_):+.4f}"
          + f" ({time.time() - t0:.0f}s)", flush=True)
    return mean, share


# ---------------------------------------------------------------- the rules tried

def routed_bits(dense):
    """bool[N + 2, L, E]: the whole trace's routes (the oracles' future)."""
    N, L, _ = dense.shape
    R = np.zeros((N + 2, L, max(int(dense.max()) + 1, 8)), bool)
    for t in range(N):
        R[t, np.arange(L)[:, None], dense[t]] = True
    return R


def _flat(ctx, ids, *keys):
    keys = tuple(np.broadcast_to(k, (ctx.L, ctx.E)).reshape(-1)[ids] for k in keys)
    return keys if len(keys) > 1 else keys[0]


def _latest(ctx):
    """prot: routed by the latest call of its layer (this token's if m <= l, else the last)."""
    m = np.arange(ctx.L)
    return ctx.R[np.where(m <= ctx.l, ctx.T, max(ctx.T - 1, 0)), m].astype(np.int64) * (
        (m <= ctx.l) | (ctx.T >= 1))[:, None]


def _ring_freq(ctx, n):
    return ctx.R[max(0, ctx.T - n + 1):ctx.T + 1].sum(0).astype(np.int64)


def _nu(ctx, K=3):
    nb = neighbours(ctx, K)
    if nb.size == 0:
        return np.zeros((ctx.L, ctx.E), np.int64), nb, None
    kj = first_k(ctx, nb, ctx.H)
    return len(nb) * dist(ctx)[:, None] + ctx.L * kj.sum(0), nb, kj


def guard(K=3, horizon=None, nu_within=False, more_than=0):
    """Evict first the residents no more than ``more_than`` of K neighbours predict within the
    horizon (LRU among them); ``nu_within``: then by largest NU."""
    def rule(ctx, ids, us):
        nb = neighbours(ctx, K)
        if nb.size == 0:
            return None
        H = ctx.H if horizon is None else horizon
        kj = first_k(ctx, nb, H)
        pred = ((kj < H).sum(0) > more_than).astype(np.int64)
        if not nu_within:
            return _flat(ctx, ids, pred)
        NU = len(nb) * dist(ctx)[:, None] + ctx.L * kj.sum(0)
        return _flat(ctx, ids, pred, -NU)
    return rule


#: P(routed at its layer's next call) in per mille, measured on seed 0 by (after = m > l, c0 =
#: neighbours routing it at the aligned next call, 0-3, r1 = routed by its layer's latest call).
P_TABLE = np.array([[[165, 330], [220, 392], [275, 435], [388, 530]],
                    [[87, 150], [254, 354], [469, 556], [750, 810]]])


def probability(kind, alpha=1.0, c=1.0, threshold=400):
    """Rules on an estimated probability p of use at the layer's next call: ``p/d`` (value per
    slot-call, smallest evicted), ``nu`` (expected next use d + c*L*(1-p), largest evicted),
    ``threshold`` ((p > threshold, -d)), ``c0`` ((c0 >= threshold, -d))."""
    def rule(ctx, ids, us):
        nb = neighbours(ctx)
        if nb.size == 0:
            return None
        c0 = (first_k(ctx, nb, 1) < 1).sum(0)
        m = np.arange(ctx.L)
        r1 = ctx.R[np.where(m <= ctx.l, ctx.T, ctx.T - 1), m].astype(int)
        after = np.broadcast_to((m > ctx.l).astype(int)[:, None], c0.shape)
        p = P_TABLE[after, np.minimum(c0, 3), r1]
        d = np.broadcast_to(dist(ctx)[:, None], c0.shape).astype(float)
        if kind == "p/d":
            return _flat(ctx, ids, p / d ** alpha)
        if kind == "nu":
            return _flat(ctx, ids, -(d + c * ctx.L * (1000 - p) / 1000))
        if kind == "threshold":
            return _flat(ctx, ids, (p > threshold).astype(int), -d)
        return _flat(ctx, ids, (c0 >= threshold).astype(int), -d)
    return rule


def ring_lfu(a=None, n=W, K=3, soft=None, r2=0):
    """(prot, a*F - NU): ``a=None`` is L (ROUTE_LFU), ``a=0`` frequency alone (F over the last
    ``n`` tokens), ``a='nu'`` -NU alone; ``soft``: one key ``score + soft*prot`` instead of the
    lexicographic pair; ``r2``: + r2*L for routed two calls of its layer ago."""
    def rule(ctx, ids, us):
        prot, F = _latest(ctx), _ring_freq(ctx, n)
        NU = _nu(ctx, K)[0] if a != 0 else 0
        weight = ctx.L if a is None else (0 if a == "nu" else a)
        score = (weight * F if a != 0 else F) - NU
        if r2:
            m = np.arange(ctx.L)
            before = np.maximum(np.where(m <= ctx.l, ctx.T, ctx.T - 1) - 1, 0)
            score = score + r2 * ctx.L * ctx.R[before, m]
        if soft is not None:
            return _flat(ctx, ids, score + soft * prot)
        return _flat(ctx, ids, prot, score)
    return rule


def oracle(kind):
    """Rules that read the future (``rule.future``): ``nextuse`` (Belady inside the simulator),
    ``y0`` (not used at its layer's next call first, then LRU), ``y0d`` (then the furthest layer
    first), ``current`` (the rest of the current token known: residents not used by it first,
    then LRU; no next-token knowledge)."""
    def rule(ctx, ids, us):
        L, l, T, R = ctx.L, ctx.l, ctx.T, rule.future
        m = np.arange(L)
        nxt = np.where(m <= l, T + 1, T)
        d = np.broadcast_to(dist(ctx)[:, None], (L, ctx.E))
        if kind == "nextuse":
            nu = np.full((L, ctx.E), 10**6)
            for k in range(7, -1, -1):
                nu = np.where(R[np.minimum(nxt + k, R.shape[0] - 1), m], d + L * k, nu)
            return _flat(ctx, ids, -nu)
        if kind == "current":
            unused = (m > l)[:, None] & ~R[T, m]
            return _flat(ctx, ids, (~unused).astype(int))
        y = R[nxt, m].astype(int)
        return _flat(ctx, ids, y) if kind == "y0" else _flat(ctx, ids, y, -d)
    rule.needs_future = True
    return rule


RULES = {
    "lru": lru,
    "route_knn": route_knn,
    "guard K=1": guard(1), "guard K=3": guard(3), "guard K=5": guard(5),
    "guard K=3, then -NU": guard(3, nu_within=True),
    "guard K=3, horizon 1": guard(3, horizon=1),
    "guard K=3, >= 2 of 3": guard(3, more_than=1),
    "p/d": probability("p/d"), "p/sqrt(d)": probability("p/d", alpha=0.5),
    "expected NU c=1": probability("nu", c=1.0), "expected NU c=0.5": probability("nu", c=0.5),
    "(p > 0.4, -d)": probability("threshold", threshold=400),
    "(c0 >= 2, -d)": probability("c0", threshold=2),
    "(prot, F16)": ring_lfu(0, n=16), "(prot, F32)": ring_lfu(0, n=32),
    "(prot, F128)": ring_lfu(0, n=128),
    "(prot, -NU)": ring_lfu("nu"),
    "(prot, 4F - NU)": ring_lfu(4), "(prot, 8F - NU)": ring_lfu(8),
    "(prot, 16F - NU)": ring_lfu(16),
    "route_lfu (prot, L*F - NU)": ring_lfu(None),
    "(prot, L*F - NU), K=5": ring_lfu(None, K=5),
    "(prot, L*F - NU + L*r2)": ring_lfu(None, r2=1),
    "soft: F + 32*prot": ring_lfu(0, soft=32),
    "soft: 8F - NU + 256*prot": ring_lfu(8, soft=256),
    "oracle_current": oracle("current"), "oracle_y0": oracle("y0"),
    "oracle_y0d": oracle("y0d"), "oracle_nextuse": oracle("nextuse"),
}


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES),
                        metavar="RULE")
    parser.add_argument("--check", action="store_true",
                        help="compare lru / route_knn / route_lfu with the library's replay")
    args = parser.parse_args(argv)
    print(f"mixtral-realistic, seeds {args.seeds}, {args.tokens} tokens: mean hit rate at "
          "S = 64 / 128 / 192 | share of the LRU->Belady gap | worst minus LRU")
    for name in args.rules:
        evaluate(name, RULES[name], seeds=tuple(args.seeds), tokens=args.tokens)
    if args.check:
        from pallas_cache.sizing.sweep import ReplayConfig, replay
        pairs = {"lru": lru, "route_knn": route_knn, "route_lfu": ring_lfu(None)}
        for seed in args.seeds:
            trace = synthetic_trace("mixtral-realistic", num_tokens=args.tokens, seed=seed)
            configs = [ReplayConfig(S, "full", eviction=e) for e in pairs for S in (64, 128, 192)]
            for config, result in zip(configs, replay(trace, configs, bounds=False,
                                                      progress=lambda status: None)):
                mine = simulate(trace.to_dense(), config.cache_size, pairs[config.eviction])
                library = 1 - result.missing / result.active
                assert abs(mine - library) < 1e-12, (seed, config, mine, library)
            print(f"seed {seed}: the simulator equals the library's replay (lru, route_knn, "
                  "route_lfu at 64 / 128 / 192)")


if __name__ == "__main__":
    main()
