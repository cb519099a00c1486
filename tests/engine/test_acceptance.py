"""The acceptance rules as pure functions, against hand-computed probabilities."""

import mlx.core as mx
import numpy as np

from speculative.round.verify import greedy_accept, lossless_accept, residual

N = 200_000
# With N samples a frequency's standard error is <= 0.0012; 0.006 is five of them, so a
# correct rule fails this bound less than once in a million runs per cell.
TOL = 0.006


def test_greedy_keeps_prefix_and_corrects():
    logits = mx.log(mx.array([[.1, .7, .2], [.6, .3, .1], [.2, .2, .6], [.3, .4, .3]]))
    n, nxt = greedy_accept(mx.array([1, 0, 1]), logits)
    assert (n.item(), nxt.item()) == (2, 2)  # third draft 1 != argmax 2: corrected to 2
    n, nxt = greedy_accept(mx.array([2, 0, 1]), logits)
    assert (n.item(), nxt.item()) == (0, 1)
    n, nxt = greedy_accept(mx.array([1, 0, 2]), logits)
    assert (n.item(), nxt.item()) == (3, 1)  # all kept: bonus is row 3's argmax


def test_residual_is_normalised_positive_part():
    r = residual(mx.array([[.5, .3, .2]]), mx.array([[.2, .5, .3]]))
    np.testing.assert_allclose(np.array(r), [[1.0, 0.0, 0.0]], atol=1e-7)


def sample(p_rows, q_rows, seed=0):
    """Run the full rule N times: drafts drawn from q, accepted against p."""
    p, q = mx.array(p_rows), mx.array(q_rows)
    keys = mx.random.split(mx.random.key(seed), N)

    def one(key):
        draft_key, accept_key = mx.random.split(key)
        drafts = mx.random.categorical(mx.log(q), axis=-1, key=draft_key)
        n, nxt = lossless_accept(drafts, q, p, accept_key)
        return drafts, n, nxt

    drafts, n, nxt = mx.vmap(one)(keys)
    return np.array(drafts), np.array(n), np.array(nxt)


def test_single_draft_marginals():
    p0, p1 = [.5, .3, .2], [.1, .1, .8]
    q0 = [.2, .5, .3]
    drafts, n, nxt = sample([p0, p1], [q0])
    # P(accept) = sum_x min(p0, q0) = .2 + .3 + .2
    assert abs((n == 1).mean() - 0.7) < TOL
    first = np.where(n == 1, drafts[:, 0], nxt)  # the first emitted token
    np.testing.assert_allclose(np.bincount(first, minlength=3) / N, p0, atol=TOL)
    # After an accepted draft the bonus comes from row 1.
    np.testing.assert_allclose(np.bincount(nxt[n == 1], minlength=3) / (n == 1).sum(), p1, atol=TOL)
    # After a rejection the correction comes from the residual: all mass on token 0.
    assert (nxt[n == 0] == 0).all()


def test_two_drafts_chain():
    p = [[.4, .4, .2], [.7, .2, .1], [.2, .3, .5]]
    q = [[.4, .2, .4], [.1, .8, .1]]
    drafts, n, nxt = sample(p, q, seed=1)
    first = np.where(n >= 1, drafts[:, 0], nxt)
    np.testing.assert_allclose(np.bincount(first, minlength=3) / N, p[0], atol=TOL)
    kept = n >= 1
    second = np.where(n[kept] >= 2, drafts[kept, 1], nxt[kept])
    np.testing.assert_allclose(np.bincount(second, minlength=3) / kept.sum(), p[1], atol=TOL)
    # P(n >= 1) = .4 + .2 + .2 ; P(n == 2 | n >= 1) = .1 + .2 + .1
    assert abs(kept.mean() - 0.8) < TOL
    assert abs((n == 2).sum() / kept.sum() - 0.4) < TOL


def test_greedy_draft_one_hot_is_lossless():
    # A greedy draft is q = one-hot(d): accepted with probability p(d), residual = p without d.
    p = [[.3, .5, .2], [.2, .2, .6]]
    q = [[0.0, 1.0, 0.0]]
    drafts, n, nxt = sample(p, q, seed=2)
    assert (drafts[:, 0] == 1).all()
    assert abs((n == 1).mean() - 0.5) < TOL
    first = np.where(n == 1, 1, nxt)
    np.testing.assert_allclose(np.bincount(first, minlength=3) / N, p[0], atol=TOL)


def test_greedy_rows_of_a_batch_are_accepted_each_on_its_own():
    logits = mx.array([[[0.0, 5.0, 0.0], [5.0, 0.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 5.0]]] * 3)
    drafts = mx.array([[1, 0, 1], [2, 0, 1], [1, 0, 2]])
    n, nxt = greedy_accept(drafts, logits)
    one = [greedy_accept(drafts[b], logits[b]) for b in range(3)]
    assert n.tolist() == [int(a.item()) for a, _ in one] == [3, 0, 2]
    assert nxt.tolist() == [int(t.item()) for _, t in one] == [2, 1, 1]
