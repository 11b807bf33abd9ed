"""Validator corpus: sampling, logits processing, guards and debugging left in a step.

``bad_*`` FUNCs mark each hazard with ``# expect: KIND``; ``safe_*`` FUNCs have none.
"""
import torch

import graphrt

V, EOS = 16, 2  # vocab size, end-of-sequence id


def _spec(fn, live_count=None, **extra):
    inputs = {"logits": graphrt.Input((None, V), torch.float32), **extra}
    return graphrt.StepSpec(fn=fn, inputs=inputs, max_batch_size=8, live_count=live_count)


_PREV = graphrt.Input((None, 4), torch.int64, high=V)  # recently generated tokens


# -- hazardous ---------------------------------------------------------------------------------
def bad_equal_guard(device):
    """Skip the penalty when the token history did not change (torch.equal guard)."""
    cache = {}

    def step(logits, prev):
        if "prev" in cache and torch.equal(prev, cache["prev"]):  # expect: host-sync
            return cache["out"]
        cache["prev"], cache["out"] = prev, logits.softmax(-1)
        return cache["out"]

    return _spec(step, prev=_PREV)


def bad_allclose_assert(device):
    """A probability sanity check left in the step."""

    def step(logits):
        probs = logits.softmax(-1)
        assert torch.allclose(probs.sum(-1), torch.ones_like(probs[:, 0]))  # expect: host-sync
        return probs.argmax(-1)

    return _spec(step)


def bad_cuda_synchronize(device):
    """A timing synchronize left in the step."""

    def step(logits):
        tok = logits.argmax(-1)
        torch.cuda.synchronize()  # expect: host-sync
        return tok

    return _spec(step)


def bad_assert_all_valid(device):
    """`assert (ids >= 0).all()` reads a device bool on the host."""

    def step(logits, prev):
        assert (prev >= 0).all()  # expect: host-sync
        return logits.gather(1, prev)

    return _spec(step, prev=_PREV)


def bad_debug_print(device):
    """A debug print of the logits."""

    def step(logits):
        print("top logits:", logits.max(-1).values)  # expect: host-sync
        return logits.argmax(-1)

    return _spec(step)


def bad_fstring_log(device):
    """A log message formatted with a device value."""
    log = []

    def step(logits):
        tok = logits.argmax(-1)
        log.append(f"max prob {logits.softmax(-1).max():.3f}")  # expect: host-sync
        return tok

    return _spec(step)


def bad_masked_select_logprobs(device):
    """Log-probs of the allowed tokens only (masked_select has a data-dependent size)."""

    def step(logits, allowed):
        lp = torch.log_softmax(logits, -1)
        picked = torch.masked_select(lp, allowed)  # expect: host-sync
        return lp, picked.sum().expand(logits.shape[0])

    return _spec(step, allowed=graphrt.Input((None, V), torch.bool))


def bad_argwhere_eos(device):
    """Locate EOS tokens with argwhere."""

    def step(logits):
        tok = logits.argmax(-1)
        eos_rows = torch.argwhere(tok == EOS)  # expect: host-sync
        return tok.index_fill(0, eos_rows[:, 0], 0)

    return _spec(step)


def bad_bool_mask_copy(device):
    """Copy banned-token penalties in with a boolean mask and full-size values."""

    def step(logits, banned):
        penalty = logits - 10.0
        logits = logits.clone()
        logits[banned] = penalty[banned]  # expect: host-sync
        return logits.argmax(-1)

    return _spec(step, banned=graphrt.Input((None, V), torch.bool))


def bad_tolist_output_tokens(device):
    """Append the sampled tokens to the requests' Python lists inside the step."""
    outputs = [[] for _ in range(8)]

    def step(logits):
        tok = logits.argmax(-1)
        for out, t in zip(outputs, tok.tolist()):  # expect: host-sync
            out.append(t)
        return tok

    return _spec(step)


def bad_one_arg_where_top_p(device):
    """Top-p cut-off found with the one-argument torch.where."""

    def step(logits):
        probs, idx = logits.softmax(-1).sort(-1, descending=True)
        rows, cols = torch.where(probs.cumsum(-1) > 0.9)  # expect: host-sync
        probs = probs.index_put((rows, cols), torch.zeros_like(rows, dtype=probs.dtype))
        return idx.gather(1, probs.argmax(-1, keepdim=True))

    return _spec(step)


def bad_python_temperature(device):
    """Per-request temperatures uploaded each step from a host list."""
    temps = [0.7, 1.0, 0.9, 1.2, 1.0, 0.8, 1.1, 1.0]

    def step(logits):
        t = torch.as_tensor(temps[:logits.shape[0]], device=logits.device)  # expect: host-to-device-copy
        return (logits / t[:, None]).softmax(-1)

    return _spec(step)


# -- safe --------------------------------------------------------------------------------------
def safe_greedy(device):
    """Greedy sampling: argmax on the device."""

    def step(logits):
        return logits.argmax(-1), torch.log_softmax(logits, -1).max(-1).values

    return _spec(step)


def safe_exponential_trick_top_k(device):
    """gpt-fast multinomial_sample_one_no_sync after a top-k filter; the uniform noise is an
    input so replay and eager draw the same sample."""

    def step(logits, u):
        v, _ = torch.topk(logits, 4)
        logits = torch.where(logits < v[:, -1:], float("-inf"), logits)
        probs = torch.softmax(logits, -1)
        q = -torch.log(u)                                                     # Exp(1) noise
        return torch.argmax(probs / q, dim=-1, keepdim=True)

    return _spec(step, u=graphrt.Input((None, V), torch.float32, low=1e-6, high=1.0, pad_value=0.5))


def safe_assert_async(device):
    """A device-side assertion instead of a host assert."""

    def step(logits, prev):
        torch._assert_async((prev >= 0).all())
        return logits.gather(1, prev)

    return _spec(step, prev=_PREV)


def safe_masked_fill_banned(device):
    """Ban tokens with masked_fill and a scalar boolean-mask assignment."""

    def step(logits, banned):
        out = logits.masked_fill(banned, float("-inf"))
        out2 = logits.clone()
        out2[banned] = float("-inf")                                          # -> masked_fill_
        return out.argmax(-1), out2.softmax(-1)

    return _spec(step, banned=graphrt.Input((None, V), torch.bool))


def safe_repetition_penalty(device):
    """Repetition penalty with gather / where / scatter on the device."""

    def step(logits, prev):
        score = logits.gather(1, prev)                                        # [T, 4]
        score = torch.where(score < 0, score * 1.2, score / 1.2)
        return logits.scatter(1, prev, score)

    return _spec(step, prev=_PREV)


def safe_stop_on_eos(device):
    """EOS handling on the device: done flags and pad tokens with where."""

    def step(logits, done):
        tok = logits.argmax(-1)
        finished = done | (tok == EOS)
        return torch.where(finished, 0, tok), finished

    return _spec(step, done=graphrt.Input((None,), torch.bool))


def safe_inf_masked_logits(device):
    """Logits masked with -inf (top-k filtering, banned tokens) returned as they are, plus a
    0-d "all rows finished" flag: equal infinities compare equal in the replay check."""
    banned = torch.zeros(V, dtype=torch.bool, device=device)
    banned[EOS + 1] = True

    def step(logits, done):
        kth = logits.topk(4, dim=-1).values[:, -1:]                           # [T, 1]
        masked = logits.masked_fill(logits < kth, float("-inf"))
        masked = masked.masked_fill(banned, float("-inf"))                    # [T, V]
        return {"logits": masked, "all_done": done.all()}

    return _spec(step, done=graphrt.Input((None,), torch.bool))
