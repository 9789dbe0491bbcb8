# The Python cost benchmark (docs/python.md, Cost): 300,000 bytearray(1000) made and dropped
# in a function called from the module (three Python frames), timed by the script itself.
import time

N = 300_000


def make():
    return bytearray(1000)


def run():
    for _ in range(N):
        make()


t = time.perf_counter()
run()
print(f"{(time.perf_counter() - t) / N * 1e6:.2f} us an iteration")
