"""Two running `gumiho serve` servers, the same request to each in turns: the speedup a
client of the API sees (tokens per second of request wall time, measured by the client).

    gumiho serve --method gumiho --draft gumiho/assets/smollm2/gumiho --preset demo --port 8131 &
    gumiho serve --method ar --port 8132 &
    python scripts/serve_ab.py http://127.0.0.1:8131 http://127.0.0.1:8132 [--rounds 5]

Which server goes first alternates by round; prints each round's tokens/s, the ratio, and
whether the two answers are the same text (at T = 0 they must be).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request

PROMPT = "Explain in a few sentences why the sky is blue."  # the demo's


def ask(url: str, prompt: str, max_tokens: int) -> tuple[dict, float]:
    body = json.dumps({"messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.load(response)
    return answer, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("fast", help="the speculative server's base URL")
    p.add_argument("plain", help="the plain-decoding server's base URL")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompt", default=PROMPT)
    a = p.parse_args()
    ratios = []
    for i in range(a.rounds):
        order = (a.fast, a.plain) if i % 2 == 0 else (a.plain, a.fast)
        got = {url: ask(url, a.prompt, a.max_tokens) for url in order}
        (fast, fast_s), (plain, plain_s) = got[a.fast], got[a.plain]
        rate_fast = fast["usage"]["completion_tokens"] / fast_s
        rate_plain = plain["usage"]["completion_tokens"] / plain_s
        same = fast["choices"][0]["message"] == plain["choices"][0]["message"]
        ratios.append(rate_fast / rate_plain)
        print(f"round {i}: {rate_fast:.1f} against {rate_plain:.1f} tokens/s, "
              f"{ratios[-1]:.2f}x (tau {fast['speculative']['tau']}), same text: {same}")
    print(f"median {statistics.median(ratios):.2f}x over {a.rounds} rounds")


if __name__ == "__main__":
    main()
