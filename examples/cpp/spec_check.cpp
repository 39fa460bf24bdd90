// Links libdspark_capi, runs greedy speculative generation on the tiny golden models and checks
// it against target-only generation, token for token.
//
//   cargo build -p dspark-capi
//   g++ -std=c++17 -Iinclude examples/cpp/spec_check.cpp -Ltarget/debug -ldspark_capi -o spec_check
//   LD_LIBRARY_PATH=target/debug ./spec_check dspark/tests/fixtures/golden
#include <cstdio>
#include <string>
#include <vector>

#include "dspark.h"

namespace {

struct Engine {
    DsparkEngine* handle = nullptr;
    ~Engine() { dspark_engine_free(handle); }
};

bool check(DsparkStatus status, const char* what) {
    if (status != DSPARK_STATUS_OK) {
        std::fprintf(stderr, "%s failed (status %d): %s\n", what, static_cast<int>(status), dspark_last_error_message());
        return false;
    }
    return true;
}

void log_line(int32_t level, const char* message, void* user) {
    auto* count = static_cast<int*>(user);
    ++*count;
    std::fprintf(stderr, "[dspark log %d] %s\n", level, message);
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s GOLDEN_DIR\n", argv[0]);
        return 2;
    }
    const std::string root = argv[1];
    const std::string target = root + "/tiny-qwen3";
    const std::string draft = root + "/tiny-dspark";
    int log_lines = 0;
    if (!check(dspark_set_log_callback(log_line, &log_lines, 3), "dspark_set_log_callback")) return 1;
    std::printf("dspark %s\n", dspark_version());

    DsparkEngineParams params = dspark_engine_default_params();
    Engine plain, spec;
    if (!check(dspark_engine_create(target.c_str(), nullptr, &params, &plain.handle), "create target-only")) return 1;
    if (!check(dspark_engine_create(target.c_str(), draft.c_str(), &params, &spec.handle), "create speculative"))
        return 1;

    const std::vector<uint32_t> prompt = {37, 35, 253, 491, 331};
    DsparkSamplingParams sampling = dspark_sampling_default_params();
    sampling.max_new_tokens = 24;
    std::vector<uint32_t> a(sampling.max_new_tokens), b(sampling.max_new_tokens);
    size_t a_len = 0, b_len = 0;
    DsparkGenerationStats stats{};
    if (!check(dspark_engine_generate(plain.handle, prompt.data(), prompt.size(), &sampling, a.data(), a.size(),
                                      &a_len, nullptr),
               "generate target-only"))
        return 1;
    if (!check(dspark_engine_generate(spec.handle, prompt.data(), prompt.size(), &sampling, b.data(), b.size(),
                                      &b_len, &stats),
               "generate speculative"))
        return 1;
    a.resize(a_len);
    b.resize(b_len);
    std::printf("speculative: %zu tokens in %zu rounds, tau %.2f, %zu of %zu drafts accepted\n", b_len, stats.rounds,
                stats.tau, stats.accepted, stats.drafted);
    if (a != b || a_len != 24) {
        std::fprintf(stderr, "MISMATCH between speculative and target-only output\n");
        return 1;
    }
    std::printf("greedy speculative == target-only for all %zu tokens\n", a_len);

    // Serving calls: two requests join the speculative engine a step apart; both must equal the
    // target-only output for their prompt.
    {
        const std::vector<uint32_t> second = {220, 79, 107, 117, 73};
        std::vector<uint32_t> second_ref(sampling.max_new_tokens);
        size_t second_len = 0;
        if (!check(dspark_engine_generate(plain.handle, second.data(), second.size(), &sampling, second_ref.data(),
                                          second_ref.size(), &second_len, nullptr),
                   "generate target-only (second prompt)"))
            return 1;
        second_ref.resize(second_len);
        uint64_t ids[2] = {0, 0};
        size_t running = 0, waiting = 0;
        if (!check(dspark_engine_submit(spec.handle, prompt.data(), prompt.size(), &sampling, &ids[0]), "submit")) return 1;
        if (!check(dspark_engine_step(spec.handle, &running, &waiting, nullptr), "step")) return 1;
        if (!check(dspark_engine_submit(spec.handle, second.data(), second.size(), &sampling, &ids[1]), "submit")) return 1;
        do {
            if (!check(dspark_engine_step(spec.handle, &running, &waiting, nullptr), "step")) return 1;
        } while (running + waiting > 0);
        const std::vector<uint32_t>* refs[2] = {&a, &second_ref};
        for (int i = 0; i < 2; ++i) {
            std::vector<uint32_t> got(64);
            size_t len = 0;
            int32_t finish = DSPARK_FINISH_NONE_YET;
            if (!check(dspark_engine_request_tokens(spec.handle, ids[i], got.data(), got.size(), &len, &finish, nullptr),
                       "request_tokens"))
                return 1;
            got.resize(len);
            if (got != *refs[i] || finish != DSPARK_FINISH_LENGTH) {
                std::fprintf(stderr, "MISMATCH in served request %d\n", i);
                return 1;
            }
            if (!check(dspark_engine_release(spec.handle, ids[i]), "release")) return 1;
        }
        std::printf("served: 2 requests joined a step apart, both == target-only\n");
    }

    // Scoring, and errors that must come back as statuses with a message.
    std::vector<float> logprobs(prompt.size() - 1);
    if (!check(dspark_engine_score(plain.handle, prompt.data(), prompt.size(), logprobs.data(), logprobs.size()),
               "score"))
        return 1;
    const std::vector<uint32_t> bad = {3, 512};
    DsparkStatus status = dspark_engine_generate(plain.handle, bad.data(), bad.size(), &sampling, a.data(), a.size(),
                                                 &a_len, nullptr);
    if (status != DSPARK_STATUS_TOKEN_OUT_OF_RANGE) {
        std::fprintf(stderr, "expected TOKEN_OUT_OF_RANGE, got %d\n", static_cast<int>(status));
        return 1;
    }
    std::printf("bad token id -> status %d: %s\n", static_cast<int>(status), dspark_last_error_message());
    DsparkEngine* none = nullptr;
    status = dspark_engine_create("/nonexistent", nullptr, nullptr, &none);
    if (status != DSPARK_STATUS_IO || none != nullptr) {
        std::fprintf(stderr, "expected IO error, got %d\n", static_cast<int>(status));
        return 1;
    }
    std::printf("bad path -> status %d: %s\n", static_cast<int>(status), dspark_last_error_message());
    std::vector<uint32_t> tiny(2);
    status = dspark_engine_generate(plain.handle, prompt.data(), prompt.size(), &sampling, tiny.data(), tiny.size(),
                                    &a_len, nullptr);
    if (status != DSPARK_STATUS_BUFFER_TOO_SMALL || a_len != 24) {
        std::fprintf(stderr, "expected BUFFER_TOO_SMALL with length 24, got %d / %zu\n", static_cast<int>(status), a_len);
        return 1;
    }
    std::printf("small buffer -> status %d, needs %zu\n", static_cast<int>(status), a_len);

    // Acceptance functions for engines that own their target (host buffers).
    {
        const std::vector<uint32_t> drafts = {11, 12, 13, 14};
        const std::vector<uint32_t> argmax = {11, 12, 99, 0, 0};
        std::vector<uint32_t> committed(drafts.size() + 1);
        size_t len = 0, accepted = 0;
        if (!check(dspark_accept_greedy(drafts.data(), drafts.size(), argmax.data(), committed.data(),
                                        committed.size(), &len, &accepted),
                   "dspark_accept_greedy"))
            return 1;
        if (accepted != 2 || len != 3 || committed[2] != 99) {
            std::fprintf(stderr, "greedy acceptance: accepted %zu, len %zu\n", accepted, len);
            return 1;
        }
        // One-hot target rows: a draft is accepted iff it is the target's token; the bonus is the
        // target's token at the first rejection, whatever the coins.
        const size_t vocab = 4;
        const std::vector<uint32_t> d = {1, 3};
        std::vector<float> p((d.size() + 1) * vocab, 0.0f), q(d.size() * vocab, 0.25f);
        p[0 * vocab + 1] = 1.0f;  // row 0 wants 1: draft 1 accepted
        p[1 * vocab + 2] = 1.0f;  // row 1 wants 2: draft 3 rejected, residual -> 2
        p[2 * vocab + 0] = 1.0f;
        if (!check(dspark_accept_chain(d.data(), d.size(), p.data(), q.data(), vocab, 7, 10, committed.data(),
                                       committed.size(), &len, &accepted),
                   "dspark_accept_chain"))
            return 1;
        if (accepted != 1 || len != 2 || committed[0] != 1 || committed[1] != 2) {
            std::fprintf(stderr, "chain acceptance: accepted %zu, len %zu\n", accepted, len);
            return 1;
        }
        std::printf("acceptance functions: greedy and chain verdicts as expected\n");
    }
    std::printf("log lines received: %d\n", log_lines);
    return log_lines > 0 ? 0 : 1;
}
