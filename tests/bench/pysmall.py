# pymalloc against PYTHONMALLOC=malloc (docs/python.md): 1,000,000 iterations of a
# bytearray(200) and a tuple in a function, timed by the script itself.
import time


def run():
    for i in range(1_000_000):
        x = bytearray(200)
        y = (i, x)  # noqa: F841


t = time.perf_counter()
run()
print(f"{(time.perf_counter() - t) * 1e3:.0f} ms")
