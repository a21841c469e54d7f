"""`iterserve up` as the user runs it, in a subprocess, for end-to-end tests: the benchmark
harness's ServerProcess, plus what the tests check about the processes it leaves behind."""

import json
import urllib.request

import psutil

from services.bench.server import REPO, ServerProcess

__all__ = ["REPO", "System", "assert_emulated_completion"]


def assert_emulated_completion(url: str, seed: int = 42, max_tokens: int = 6) -> None:
    """A sampled completion from a system of EMULATED workers is exactly the tokens derived from
    its seed and its prompt (services/worker/emulated.py emulated_tokens), whichever worker ran it."""
    from services.worker.emulated import emulated_tokens
    from shared.tokenizer import Tokenizer

    body = json.dumps({"model": "smollm2-135m-instruct", "prompt": "Hello there", "max_tokens": max_tokens,
                       "seed": seed, "temperature": 0.7}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    tokenizer = Tokenizer.load()
    expected = tokenizer.decode(emulated_tokens(seed, tokenizer.encode_prompt("Hello there"), max_tokens,
                                                tokenizer.vocab_size))
    assert answer["choices"][0]["text"] == expected, (answer["choices"][0]["text"], expected)


class System(ServerProcess):
    def __init__(self, *args: str, workers: int = 2, kv_blocks: int = 256, env: dict[str, str] | None = None):
        """args: more `iterserve up` options (a later --policy overrides the default)."""
        super().__init__(workers=workers, kv_blocks=kv_blocks, extra_args=args, env=env)

    @property
    def base_url(self) -> str:
        return self.url

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> list[psutil.Process]:
        """SIGTERM `up`, as a user's Ctrl-C would; returns the processes it left alive (killed)."""
        if self.process is None:
            return []
        children = self.descendants()
        self.terminate()
        _, alive = psutil.wait_procs(children, timeout=5)
        leftovers = [process for process in alive if process.is_running()]
        self.kill_group_and_reap()  # whatever happened, the test leaves nothing behind
        for process in leftovers:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        return leftovers
