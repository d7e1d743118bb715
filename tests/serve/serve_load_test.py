#!/usr/bin/env python3
"""A bounded load test of `ringlm serve` on loopback: many concurrent streaming clients, some of
which hang up mid-stream, for a fixed time.

  serve_load_test.py RINGLM MODEL [--clients 32] [--seconds 60] [--parallel 16] [--max-tokens 24]

Checks that every stream that was read to its end is well-formed server-sent events ending in
`data: [DONE]`, that every chunk of a stream carries that stream's id only, that each greedy text
equals `ringlm run`'s for its prompt (each prompt continues differently, so a token of one
request in another's stream shows), that the server is idle afterwards, and that its memory is
flat: the resident size after the load is within a bound of the size after a first warm-up round."""
import argparse
import http.client
import json
import random
import re
import subprocess
import sys
import threading
import time

PROMPTS = ["The capital of France is", "Once upon a time", "The three primary colors are",
           "My favourite food is", "The best way to learn a language is", "In the year 2050,",
           "The ocean is", "Python is a programming language that"]
def ringlm_run(ringlm, model, prompt, max_tokens):
    return subprocess.run([ringlm, "run", "-m", model, "-p", prompt, "-n", str(max_tokens), "--temp", "0", "-t", "1"],
                          capture_output=True, text=True, check=True, timeout=300).stdout


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


class Failure(Exception):
    pass


def stream_once(port, prompt, max_tokens, hang_up_after=None):
    """One streamed completion. Returns its text, or None when this client hung up on purpose."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise Failure(f"status {r.status}: {r.read()[:200]!r}")
    if r.getheader("Content-Type", "").split(";")[0] != "text/event-stream":
        raise Failure("content type " + r.getheader("Content-Type", ""))
    text, ids, finish, events = [], set(), [], 0
    while True:
        line = r.readline().decode()
        if line == "":
            raise Failure("the stream ended without data: [DONE]")
        if line == "\n":
            continue
        if not line.startswith("data: ") or not line.endswith("\n"):
            raise Failure("not an event line: " + repr(line))
        data = line[6:].strip()
        if r.readline() != b"\n":
            raise Failure("an event without its blank line")
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        ids.add(chunk["id"])
        for c in chunk["choices"]:
            text.append(c["text"])
            if c["finish_reason"]:
                finish.append(c["finish_reason"])
        events += 1
        if hang_up_after is not None and events >= hang_up_after:
            conn.sock.close()  # gone mid-stream, without a word
            conn.close()
            return None
    if r.readline() != b"":
        raise Failure("bytes after data: [DONE]")
    conn.close()
    if len(ids) != 1:
        raise Failure(f"chunks of {len(ids)} different responses in one stream")
    if len(finish) != 1 or finish[0] not in ("stop", "length"):
        raise Failure(f"finish reasons {finish}")
    return "".join(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ringlm")
    ap.add_argument("model")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=24, help="tokens per request")
    ap.add_argument("--sanitized", action="store_true",
                    help="ringlm is built with AddressSanitizer, whose quarantine of freed memory grows the "
                         "resident size: leave memory to LeakSanitizer (a leak fails the exit)")
    args = ap.parse_args()

    expected = {p: ringlm_run(args.ringlm, args.model, p, args.max_tokens) for p in PROMPTS}
    if len(set(expected.values())) != len(PROMPTS):
        sys.exit("FAIL: two prompts continue alike; mixing would not show")
    server = subprocess.Popen([args.ringlm, "serve", "-m", args.model, "--port", "0", "--parallel", str(args.parallel),
                               "-c", "512", "-t", str(args.threads), "--max-queue", str(4 * args.clients)],
                              stderr=subprocess.PIPE, text=True)
    port = int(re.search(r":(\d+) ", server.stderr.readline()).group(1))
    threading.Thread(target=lambda: [None for _ in server.stderr], daemon=True).start()  # drain the log
    while True:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                break
        except OSError:
            pass
        time.sleep(0.05)

    failures, counts, lock = [], {"complete": 0, "hung_up": 0}, threading.Lock()

    def client(i, stop_at, warm_up):
        rng = random.Random(i)
        j = 0
        while (j == 0 or time.time() < stop_at) and not failures:
            prompt = PROMPTS[(i + j) % len(PROMPTS)]
            # Every fourth client hangs up on every other request, at a random event.
            hang_up = rng.randint(1, 10) if not warm_up and i % 4 == 3 and j % 2 == 0 else None
            j += 1
            try:
                text = stream_once(port, prompt, args.max_tokens, hang_up)
            except (Failure, OSError, ValueError, KeyError) as e:
                with lock:
                    failures.append(f"client {i}: {prompt!r}: {e}")
                return
            with lock:
                if text is None:
                    counts["hung_up"] += 1
                elif text != expected[prompt]:
                    failures.append(f"client {i}: {prompt!r}: got {text!r}, ringlm run says {expected[prompt]!r}")
                else:
                    counts["complete"] += 1

    def round_of(seconds, warm_up=False):
        stop_at = time.time() + seconds
        threads = [threading.Thread(target=client, args=(i, stop_at, warm_up)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    round_of(0, warm_up=True)  # one whole request per client, every slot used
    time.sleep(0.5)
    rss_warm = rss_kib(server.pid)
    started = time.time()
    round_of(args.seconds)
    elapsed = time.time() - started
    time.sleep(1.0)
    rss_after = rss_kib(server.pid)

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    c.request("GET", "/metrics")
    metrics = c.getresponse().read().decode()
    server.terminate()
    code = server.wait(timeout=60)

    print(f"{args.clients} clients, {elapsed:.0f} s: {counts['complete']} streams complete, {counts['hung_up']} hung up; "
          f"RSS {rss_warm / 1024:.1f} MiB after warm-up, {rss_after / 1024:.1f} MiB after the load")
    for f in failures[:10]:
        print("FAIL:", f)
    for name in ("ringlm_sequences_running", "ringlm_requests_queued", "ringlm_kv_cache_bytes"):
        value = float(re.search(rf"^{name} (\S+)$", metrics, re.M).group(1))
        if value != 0:
            failures.append(f"{name} is {value} after the load")
            print("FAIL:", failures[-1])
    if counts["complete"] < args.clients or counts["hung_up"] == 0:
        failures.append("too few streams to judge")
        print("FAIL:", failures[-1])
    # Flat: the allocator may keep some freed pages, but a leak per request (thousands here) shows.
    if not args.sanitized and rss_after > rss_warm * 1.10 + 16 * 1024:
        failures.append("memory grew")
        print("FAIL: memory grew")
    if code != 0:
        failures.append(f"ringlm serve exited {code}")
        print("FAIL:", failures[-1])
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
