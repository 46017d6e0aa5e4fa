// HMAC-SHA256, used to prove that both ends of a connection know the job's secret.
// Self-contained so the engine links against nothing but libc.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace sdp {

using Digest = std::array<uint8_t, 32>;

Digest sha256(const uint8_t* data, size_t len);
Digest hmac_sha256(const std::string& key, const uint8_t* msg, size_t len);
// Constant-time comparison: a wrong proof must not leak how many bytes matched.
bool digest_equal(const Digest& a, const Digest& b);
// Fills buf from the kernel's CSPRNG (getrandom).
void random_bytes(uint8_t* buf, size_t len);

}  // namespace sdp
