/* parse-json (as in Heapprof): the threads share PARSES passes over a JSON input, parsing it
 * with nlohmann::json, walking each result and freeing it. The input is cut into CHUNKS
 * documents (arrays of records), so a pass is CHUNKS parses and SCALE can take part of one.
 * Heapprof parsed a 170 MB file once per thread; here the file is smaller (made by
 * --generate, see below).
 *
 *   parse-json P [SCALE [SECONDS]]       reads $PARSE_JSON_INPUT, or parse-json.json next to
 *                                        the executable
 *   parse-json --generate FILE RECORDS   writes the input: an array of RECORDS records, one a
 *                                        line (deterministic; 5000 records are about 2.9 MB)
 */
#include <nlohmann/json.hpp>

#include <fstream>
#include <vector>
#include <string>
#include <unistd.h>

#include "bench.h"

#define PARSES 4
#define CHUNKS 16

using nlohmann::json;

static std::vector<std::string> chunks;
static volatile uint64_t sink;

static uint64_t walk(const json &j) {
    uint64_t n = 1;
    if (j.is_object() || j.is_array())
        for (const auto &v : j)
            n += walk(v);
    else if (j.is_string())
        n += j.get_ref<const std::string &>().size();
    return n;
}

static void *worker(void *arg) {
    struct bench_thread *t = (struct bench_thread *)arg;
    long n = bench_part(t->b, t->id, PARSES * CHUNKS);
    uint64_t sum = 0;
    for (long i = 0; i < n; i++) {
        json doc = json::parse(chunks[(size_t)(t->id + i) % CHUNKS]);
        sum += walk(doc);
    }
    sink += sum;
    return NULL;
}

static std::string word(uint64_t *seed, int min, int max) {
    static const char letters[] = "abcdefghijklmnopqrstuvwxyz";
    int len = min + (int)(bench_rand(seed) % (uint64_t)(max - min + 1));
    std::string s;
    for (int i = 0; i < len; i++)
        s += letters[bench_rand(seed) % 26];
    return s;
}

static int generate(const char *path, long records) {
    uint64_t seed = bench_seed(42);
    std::ofstream out(path);
    out << "[\n";
    for (long i = 0; i < records; i++) {
        json r;
        r["id"] = i;
        r["name"] = word(&seed, 4, 12) + " " + word(&seed, 5, 20);
        r["email"] = word(&seed, 6, 18) + "@" + word(&seed, 4, 10) + ".example.org";
        r["score"] = (double)(bench_rand(&seed) % 100000) / 100.0;
        r["active"] = bench_rand(&seed) % 2 == 0;
        json tags = json::array();
        for (int k = (int)(bench_rand(&seed) % 6); k > 0; k--)
            tags.push_back(word(&seed, 3, 24));
        r["tags"] = tags;
        r["address"] = {{"street", word(&seed, 5, 25)},
                        {"city", word(&seed, 4, 16)},
                        {"postal_code", std::to_string(bench_rand(&seed) % 100000)}};
        json history = json::array();
        for (int k = (int)(bench_rand(&seed) % 8); k > 0; k--)
            history.push_back({{"timestamp", 1600000000 + bench_rand(&seed) % 100000000},
                               {"value", (double)(bench_rand(&seed) % 1000) / 10.0},
                               {"description_of_event", word(&seed, 10, 40)}});
        r["history"] = history;
        out << r.dump() << (i + 1 < records ? ",\n" : "\n");
    }
    out << "]\n";
    return out.good() ? 0 : 1;
}

int main(int argc, char **argv) {
    if (argc == 4 && std::string(argv[1]) == "--generate")
        return generate(argv[2], atol(argv[3]));
    struct bench b;
    bench_args(&b, "parse-json", argc, argv);
    std::string path;
    if (const char *p = getenv("PARSE_JSON_INPUT")) {
        path = p;
    } else {
        char exe[4096];
        ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
        if (n <= 0)
            return 2;
        exe[n] = 0;
        path = std::string(exe);
        path = path.substr(0, path.rfind('/') + 1) + "parse-json.json";
    }
    std::ifstream in(path);
    if (!in) {
        fprintf(stderr, "parse-json: cannot read %s (make it with --generate)\n", path.c_str());
        return 2;
    }
    /* The records, one a line between "[" and "]", each but the last ending with a comma. */
    std::vector<std::string> records;
    for (std::string line; std::getline(in, line);) {
        if (line == "[" || line == "]" || line.empty())
            continue;
        if (line.back() == ',')
            line.pop_back();
        records.push_back(line);
    }
    if (records.size() < CHUNKS) {
        fprintf(stderr, "parse-json: %s has fewer than %d records\n", path.c_str(), CHUNKS);
        return 2;
    }
    for (size_t c = 0; c < CHUNKS; c++) {
        std::string doc = "[\n";
        for (size_t r = c * records.size() / CHUNKS; r < (c + 1) * records.size() / CHUNKS; r++)
            doc += records[r] + (r + 1 < (c + 1) * records.size() / CHUNKS ? ",\n" : "\n");
        chunks.push_back(doc + "]\n");
    }
    bench_start(&b);
    do
        bench_threads(&b, worker);
    while (bench_again(&b));
    bench_done(&b);
    return 0;
}
