"""The agent endpoint's own CPU per request, in the trainer's process: the `Endpoint` (rlloom/agents/
server.py) answered at once by a thread standing in for the engine's, a client in another process
sending one chat request after another on one keep-alive connection (plain `http.client`, so the
client's own cost stays out of this process). Prints the endpoint thread's CPU time per request (what
it takes from the engine thread's GIL in a run) and the round trip.

    python benchmarks/bench_endpoint.py --requests 2000
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

CLIENT = """
import http.client, json, socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
c = http.client.HTTPConnection("127.0.0.1", port)
c.connect()
c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
messages = [
    {"role": "user", "content": "What is 2 + 2? " * 20},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "observation 1"},
]
body = json.dumps({"model": "m", "messages": messages, "temperature": 1.0, "max_tokens": 64})
start = time.perf_counter()
for _ in range(n):
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    assert r.status == 200, r.status
print((time.perf_counter() - start) / n)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()
    from rlloom.agents.api import Answer, Choice
    from rlloom.agents.server import Endpoint

    endpoint = Endpoint(model_id="m", sessions_only=False)
    endpoint.start()
    done = threading.Event()
    answer = Answer(
        choices=[Choice(token_ids=[1, 2], logprobs=[-0.1, -0.2], pieces=[], text="4", finish_reason="stop")],
        prompt_tokens=40,
    )

    def engine() -> None:
        while not done.is_set():
            for call in endpoint.take(0.05):
                call.reply(answer)

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    clock = time.pthread_getcpuclockid(endpoint._thread.ident)
    cpu = time.clock_gettime(clock)
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, str(endpoint.url.rsplit(":", 1)[1]), str(args.requests)],
        check=True,
        capture_output=True,
        text=True,
    )
    cpu = time.clock_gettime(clock) - cpu
    done.set()
    thread.join()
    endpoint.close()
    print(
        f"endpoint thread CPU {cpu / args.requests * 1e3:.3f} ms a request; "
        f"round trip {float(out.stdout) * 1e3:.2f} ms ({args.requests} requests)"
    )


if __name__ == "__main__":
    main()
