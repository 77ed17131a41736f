"""An empirical check of privacy that does not trust the accountant: a loss-threshold membership-inference attack
(Yeom et al., CSF 2018) on the global model. The attacker scores an example by its negative cross-entropy under the
model and guesses "member" above a threshold; over every threshold its success is the AUC of that score on members
(a seeded sample of the clients' training examples, ``privacy.mia_samples``) against non-members (the global test
set, from the same distribution and never trained on): ``diag/mia_auc``, 0.5 when the model does not tell them
apart. The members are extra rows of the evaluation set (:class:`fedray.evaluation.EvalIndex`), scored in its fixed
batches, so the figure is the same in process and on Ray. A personalised method's clients are each audited on their
own model: its own members against the global test set, the pairs pooled over the clients (sum of U / sum of
pairs)."""

from __future__ import annotations

import numpy as np

from fedray.seeding import derive_seed


def membership_rows(cfg, data) -> np.ndarray | None:
    """The rows of ``data.train_x`` the audit scores as members: ``privacy.mia_samples`` of the clients' training
    examples drawn without replacement by the run's seed (all of them when fewer), sorted; None without an audit."""
    n = cfg.privacy.mia_samples
    if n == 0:
        return None
    rows = np.concatenate([np.asarray(t, dtype=np.int64) for t in data.client_train])
    rng = np.random.default_rng(derive_seed(cfg.seed, "privacy/mia"))
    return np.sort(rng.choice(rows, size=min(n, len(rows)), replace=False))


def membership_u(member_loss: np.ndarray, nonmember_loss: np.ndarray) -> tuple[float, float]:
    """(the pairs (member, non-member) whose member scores higher, ties counted half; the pairs): the Mann-Whitney U
    of the scores -loss (scipy). Personal models pool these over their clients: sum U / sum pairs."""
    from scipy.stats import mannwhitneyu

    if len(member_loss) == 0 or len(nonmember_loss) == 0:
        return 0.0, 0.0
    u = mannwhitneyu(-np.asarray(member_loss, np.float64), -np.asarray(nonmember_loss, np.float64),
                     alternative="greater").statistic
    return float(u), float(len(member_loss) * len(nonmember_loss))


def membership_auc(member_loss: np.ndarray, nonmember_loss: np.ndarray) -> float:
    """P(a member's score > a non-member's), ties counted half (:func:`membership_u`)."""
    u, pairs = membership_u(member_loss, nonmember_loss)
    return u / pairs


__all__ = ["membership_auc", "membership_rows", "membership_u"]
