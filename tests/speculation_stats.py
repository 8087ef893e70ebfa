"""The statistical test of speculative decoding, on toy tables: speculate with a verify rule, count
the first two emitted tokens, and compare their frequencies with the target's (chi-square)."""
import torch

from petite_llm.model.sampling import draw, exponential_noise
from petite_llm.engine.speculative import emitted_tokens, verify_drafts


def speculate_pairs(target_probs: torch.Tensor, draft_probs: torch.Tensor, first_token: int,
                    num_speculative_tokens: int, num_trials: int, generator: torch.Generator,
                    verify=verify_drafts, one_hot: bool = False) -> torch.Tensor:
    "The first two tokens emitted by toy speculation after first_token, per trial: [N, 2]."
    # target_probs, draft_probs [V, V]: the processed next-token distribution after each token;
    # one_hot: the drafts are the draft table's argmax, q one-hot (as n-gram drafts are)
    V = target_probs.shape[-1]

    def one_step(last):                                                     # last [N]
        n, prev, drafts = len(last), last, []
        for _ in range(num_speculative_tokens):
            noise = torch.ones(n, V) if one_hot else exponential_noise((n, V), generator)
            prev = draw(draft_probs[prev], noise)
            drafts.append(prev)
        before = torch.stack([last] + drafts, 1)       # [N, k+1]: the token before each row
        ids = torch.cat([torch.stack(drafts, 1), torch.full((n, 1), -1)], 1).reshape(-1)
        q = torch.cat([draft_probs[before[:, :-1]], torch.zeros(n, 1, V)], 1).reshape(-1, V)
        p = target_probs[before].reshape(-1, V)                             # [N*(k+1), V]
        accepted, recovered = verify(p, ids, None if one_hot else q,
                                     exponential_noise(p.shape, generator))
        return emitted_tokens(accepted, recovered, ids, [num_speculative_tokens + 1] * n)

    tokens = one_step(torch.full((num_trials,), first_token))
    # trials whose first draft was rejected speculate once more for their second token
    short = [i for i, t in enumerate(tokens) if len(t) == 1]
    for i, more in zip(short, one_step(torch.tensor([tokens[i][0] for i in short]))):
        tokens[i] = tokens[i] + more[:1]
    return torch.tensor([t[:2] for t in tokens])


def pair_chi_square(pairs: torch.Tensor, target_probs: torch.Tensor,
                    first_token: int) -> tuple[float, int, int]:
    "Chi-square of pair counts [N, 2] against p(a|first) p(b|a): (statistic, df, forbidden seen)."
    V, num_trials = target_probs.shape[-1], len(pairs)
    expected = (target_probs[first_token].unsqueeze(1) * target_probs).reshape(-1) * num_trials
    observed = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double()
    possible = expected > 0
    diff = observed[possible] - expected[possible]
    statistic = (diff ** 2 / expected[possible]).sum().item()
    return statistic, int(possible.sum()) - 1, int(observed[~possible].sum())


def wrong_acceptance(p, ids, q, noise):
    "Accepts a draft with probability p(x), as if q were one-hot."
    _, recovered = verify_drafts(p, ids, q, noise)
    x = ids.clamp(min=0).unsqueeze(-1)
    u = torch.exp(-noise.gather(-1, x)[:, 0])
    return (ids >= 0) & (u < p.gather(-1, x)[:, 0]), recovered



def wrong_residual(p, ids, q, noise):
    "Redraws a rejected position from p instead of norm(max(p - q, 0))."
    accepted, _ = verify_drafts(p, ids, q, noise)
    return accepted, draw(p, noise)
