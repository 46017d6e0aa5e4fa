// The mailbox's matching rules (native/include/sdp/matching.h), without a socket or a thread.
// Built and run by tests/engine/test_mailbox_matching.py: `test_matching NAME` runs one case,
// `test_matching` runs them all; a failed check prints its line and exits with 1.
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "sdp/matching.h"

using namespace sdp;

namespace {

int failures = 0;

#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::printf("%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                     \
    }                                                                 \
  } while (0)

// Records what the matcher tells the mailbox.
struct Events : MatchEvents {
  int finished_count = 0;
  std::vector<int> resumed;
  void finished() override { ++finished_count; }
  void resume(int src) override { resumed.push_back(src); }
  std::string who(int r) const override { return "rank " + std::to_string(r); }
};

struct Fixture {
  Events ev;
  Matcher m{4, ev};  // a group of 4 ranks; this rank receives from 1, 2, 3
};

MailOpPtr recv(int src, int64_t tag, std::vector<char>& buf) {
  auto op = std::make_shared<MailOp>();
  op->peer = src;
  op->tag = tag;
  op->data = buf.data();
  op->nbytes = buf.size();
  return op;
}

std::vector<char> bytes(size_t n, char fill) { return std::vector<char>(n, fill); }

// A whole message arriving from `src` as the mailbox would read it: header, then every piece
// where the matcher says (at most `piece` bytes a read).
void arrive(Matcher& m, int src, int64_t tag, const std::vector<char>& payload, size_t piece = 1 << 30) {
  m.begin(src, tag, payload.size());
  size_t at = 0;
  while (m.receiving(src) && !m.parked(src)) {
    Matcher::Space s = m.space(src);
    size_t n = std::min({s.len, piece, payload.size() - at});
    std::memcpy(s.data, payload.data() + at, n);
    at += n;
    m.received(src, n);
  }
}

bool ok(const MailOpPtr& op) { return op->finished && op->error.empty(); }

// ------------------------------------------------------------------------------------- cases

void posted_receive_then_arrival() {
  Fixture f;
  auto buf = bytes(8, 0);
  auto r = recv(1, 5, buf);
  f.m.post(r);
  CHECK(!r->finished);
  CHECK(f.m.posted_count() == 1);
  f.m.begin(1, 5, 8);
  Matcher::Space s = f.m.space(1);
  CHECK(s.data == buf.data());  // straight into the receive's buffer, no copy
  CHECK(s.len == 8);
  std::memset(s.data, 'x', 8);
  f.m.received(1, 8);
  CHECK(ok(r));
  CHECK(r->source == 1);
  CHECK(buf == bytes(8, 'x'));
  CHECK(f.m.posted_count() == 0);
  CHECK(f.m.kept_count() == 0);
  CHECK(f.ev.finished_count == 1);
}

void arrival_then_receive_takes_the_kept_message() {
  Fixture f;
  arrive(f.m, 2, 9, bytes(16, 'a'));
  CHECK(f.m.kept_count() == 1);
  CHECK(f.ev.finished_count == 0);
  auto buf = bytes(16, 0);
  auto r = recv(2, 9, buf);
  f.m.post(r);
  CHECK(ok(r));
  CHECK(r->source == 2);
  CHECK(buf == bytes(16, 'a'));
  CHECK(f.m.kept_count() == 0);
  CHECK(f.m.posted_count() == 0);
}

void a_message_arriving_in_pieces_lands_in_its_receive() {
  Fixture f;
  auto buf = bytes(1000, 0);
  auto r = recv(1, 0, buf);
  f.m.post(r);
  std::vector<char> payload(1000);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = char(i * 7);
  arrive(f.m, 1, 0, payload, 33);
  CHECK(ok(r));
  CHECK(buf == payload);
}

void any_source_takes_kept_messages_in_arrival_order() {
  Fixture f;
  arrive(f.m, 3, 1, bytes(4, '3'));
  arrive(f.m, 1, 1, bytes(4, '1'));
  auto b1 = bytes(4, 0), b2 = bytes(4, 0);
  auto r1 = recv(-1, 1, b1), r2 = recv(-1, 1, b2);
  f.m.post(r1);
  f.m.post(r2);
  CHECK(ok(r1) && r1->source == 3 && b1 == bytes(4, '3'));
  CHECK(ok(r2) && r2->source == 1 && b2 == bytes(4, '1'));
}

void a_message_goes_to_the_oldest_posted_receive_that_fits() {
  Fixture f;
  auto b_any = bytes(4, 0), b_one = bytes(4, 0), b_two = bytes(4, 0);
  auto r_any = recv(-1, 0, b_any), r_one = recv(1, 0, b_one), r_two = recv(2, 0, b_two);
  f.m.post(r_any);  // oldest: any source
  f.m.post(r_one);
  f.m.post(r_two);
  arrive(f.m, 1, 0, bytes(4, 'p'));
  CHECK(ok(r_any) && r_any->source == 1);  // the any-source receive is older than rank 1's own
  CHECK(!r_one->finished);
  arrive(f.m, 1, 0, bytes(4, 'q'));
  CHECK(ok(r_one) && b_one == bytes(4, 'q'));
  CHECK(!r_two->finished);  // a message from 1 never goes to a receive from 2
  arrive(f.m, 2, 0, bytes(4, 'r'));
  CHECK(ok(r_two) && b_two == bytes(4, 'r'));
}

void tags_must_match() {
  Fixture f;
  auto b8 = bytes(4, 0), b7 = bytes(4, 0);
  auto r8 = recv(1, 8, b8);
  f.m.post(r8);
  arrive(f.m, 1, 7, bytes(4, 's'));  // tag 7: nobody waits for it, kept
  CHECK(!r8->finished);
  CHECK(f.m.kept_count() == 1);
  auto r7 = recv(-1, 7, b7);
  f.m.post(r7);
  CHECK(ok(r7) && b7 == bytes(4, 's'));
  CHECK(!r8->finished);
  CHECK(f.m.posted_count() == 1);
  int64_t big = int64_t(1) << 40, negative = -3;
  auto bb = bytes(1, 0), bn = bytes(1, 0);
  auto rb = recv(1, big, bb), rn = recv(1, negative, bn);
  f.m.post(rn);
  f.m.post(rb);
  arrive(f.m, 1, big, bytes(1, 'B'));
  CHECK(ok(rb) && !rn->finished);  // 64-bit tags, compared whole
}

void fifo_per_source_and_tag() {
  Fixture f;
  // kept first, then taken in the order they came
  for (char c : {'1', '2', '3'}) arrive(f.m, 1, 4, bytes(2, c));
  arrive(f.m, 2, 4, bytes(2, 'x'));
  for (char c : {'1', '2', '3'}) {
    auto b = bytes(2, 0);
    auto r = recv(1, 4, b);
    f.m.post(r);
    CHECK(ok(r) && b == bytes(2, c));
  }
  // receives first: the first message goes to the first receive
  std::vector<std::vector<char>> bufs(3, bytes(2, 0));
  std::vector<MailOpPtr> rs;
  for (auto& b : bufs) {
    rs.push_back(recv(3, 4, b));
    f.m.post(rs.back());
  }
  for (char c : {'a', 'b', 'c'}) arrive(f.m, 3, 4, bytes(2, c));
  CHECK(bufs[0] == bytes(2, 'a') && bufs[1] == bytes(2, 'b') && bufs[2] == bytes(2, 'c'));
  CHECK(f.m.kept_count() == 1);  // rank 2's message is still kept
}

void a_receive_posted_while_a_kept_message_arrives_takes_the_rest_in_place() {
  Fixture f;
  const size_t n = 3 * kSpillStep + 100;  // over kParkMinBytes, but a receive from 1 waits: not parked
  auto other = bytes(1, 0);
  auto r_other = recv(1, 99, other);  // waits for rank 1 (another tag)
  f.m.post(r_other);
  f.m.begin(1, 0, n);
  CHECK(!f.m.parked(1));
  Matcher::Space s = f.m.space(1);
  CHECK(s.len == kSpillStep);  // kept a piece at a time
  std::memset(s.data, 'k', s.len);
  f.m.received(1, s.len);
  std::vector<char> buf(n, 0);
  auto r = recv(1, 0, buf);
  f.m.post(r);
  CHECK(!r->finished);
  s = f.m.space(1);
  CHECK(s.data == buf.data() + kSpillStep);  // adopted: the rest goes straight into it
  CHECK(s.len == n - kSpillStep);
  CHECK(buf[0] == 'k' && buf[kSpillStep - 1] == 'k');  // what had arrived was copied over
  std::memset(s.data, 'r', s.len);
  f.m.received(1, s.len);
  CHECK(ok(r) && buf[kSpillStep] == 'r' && buf[n - 1] == 'r');
  CHECK(f.m.kept_count() == 0);
  CHECK(!r_other->finished);
}

void a_large_message_nobody_waits_for_is_parked_until_a_receive_from_its_source() {
  Fixture f;
  const size_t n = kParkMinBytes + 1;
  f.m.begin(1, 0, n);
  CHECK(f.m.parked(1));  // stays in the socket: the mailbox reads nothing more from rank 1
  CHECK(f.m.receiving(1));
  CHECK(f.m.kept_count() == 0);
  auto b2 = bytes(4, 0);
  f.m.post(recv(2, 0, b2));  // a receive from another rank does not resume rank 1
  CHECK(f.m.parked(1));
  CHECK(f.ev.resumed.empty());
  std::vector<char> buf(n, 0);
  auto r = recv(1, 0, buf);
  f.m.post(r);
  CHECK(!f.m.parked(1));
  CHECK(f.ev.resumed == std::vector<int>{1});
  Matcher::Space s = f.m.space(1);
  CHECK(s.data == buf.data() && s.len == n);  // read straight into the receive
  f.m.received(1, n);
  CHECK(ok(r));
}

void a_parked_message_resumed_by_another_tag_is_kept() {
  Fixture f;
  const size_t n = kParkMinBytes + 1;
  f.m.begin(1, 5, n);
  CHECK(f.m.parked(1));
  auto b = bytes(4, 0);
  auto r = recv(1, 6, b);  // waits for a message behind the parked one
  f.m.post(r);
  CHECK(!f.m.parked(1));
  Matcher::Space s = f.m.space(1);
  CHECK(s.data != b.data() && s.len == std::min(n, kSpillStep));
  size_t got = 0;
  while (f.m.receiving(1)) {
    s = f.m.space(1);
    got += s.len;
    f.m.received(1, s.len);
  }
  CHECK(got == n);
  CHECK(f.m.kept_count() == 1);
  CHECK(!r->finished);
}

void any_source_receive_resumes_every_parked_source() {
  Fixture f;
  f.m.begin(1, 0, kParkMinBytes + 1);
  f.m.begin(3, 0, kParkMinBytes + 1);
  CHECK(f.m.parked(1) && f.m.parked(3) && !f.m.parked(2));
  auto b = bytes(kParkMinBytes + 1, 0);
  f.m.post(recv(-1, 0, b));
  CHECK(!f.m.parked(1) && !f.m.parked(3));
  CHECK((f.ev.resumed == std::vector<int>{1, 3}));
}

void small_messages_and_waited_for_senders_are_never_parked() {
  Fixture f;
  f.m.begin(1, 0, kParkMinBytes);  // at the limit: kept, not parked
  CHECK(!f.m.parked(1));
  auto b = bytes(1, 0);
  f.m.post(recv(-1, 77, b));  // any source, another tag: every sender is waited for
  f.m.begin(2, 0, kParkMinBytes + 1);
  CHECK(!f.m.parked(2));
}

void a_receive_of_another_size_fails_naming_both_sizes_and_the_message_is_consumed() {
  Fixture f;
  auto b = bytes(8, 0);
  auto r = recv(1, 3, b);
  f.m.post(r);
  f.m.begin(1, 3, 4);
  CHECK(r->finished);
  CHECK(r->error == "recv of 8 bytes got a message of 4 bytes from rank 1 (tag 3): the two sides disagree on the size");
  Matcher::Space s = f.m.space(1);  // dropped: read into scratch, never into the receive
  CHECK(s.data != b.data());
  f.m.received(1, 4);
  CHECK(!f.m.receiving(1));
  CHECK(f.m.kept_count() == 0);
  CHECK(b == bytes(8, 0));
}

void a_kept_message_of_another_size_fails_the_receive() {
  Fixture f;
  arrive(f.m, 2, 0, bytes(4, 'z'));
  auto b = bytes(6, 0);
  auto r = recv(2, 0, b);
  f.m.post(r);
  CHECK(r->finished);
  CHECK(r->error.find("recv of 6 bytes got a message of 4 bytes from rank 2") == 0);
  CHECK(f.m.kept_count() == 0);
}

void a_receive_of_another_size_posted_mid_message_fails_when_it_completes() {
  Fixture f;
  auto other = bytes(1, 0);
  f.m.post(recv(1, 99, other));
  const size_t n = 2 * kSpillStep;
  f.m.begin(1, 0, n);
  Matcher::Space s = f.m.space(1);
  f.m.received(1, s.len);
  auto b = bytes(10, 0);
  auto r = recv(1, 0, b);
  f.m.post(r);
  s = f.m.space(1);
  CHECK(s.data != b.data());  // not adopted
  f.m.received(1, s.len);
  CHECK(r->finished && r->error.find("recv of 10 bytes got a message of 2097152 bytes") == 0);
}

void a_withdrawn_receive_is_not_matched_and_drops_the_rest_of_its_message() {
  Fixture f;
  auto b1 = bytes(4, 0);
  auto r1 = recv(1, 0, b1);
  f.m.post(r1);
  f.m.withdraw(r1);
  CHECK(f.m.posted_count() == 0);
  arrive(f.m, 1, 0, bytes(4, 'w'));
  CHECK(!r1->finished && b1 == bytes(4, 0));
  CHECK(f.m.kept_count() == 1);

  auto b2 = bytes(100, 0);
  auto r2 = recv(2, 0, b2);
  f.m.post(r2);
  f.m.begin(2, 0, 100);
  Matcher::Space s = f.m.space(2);
  std::memset(s.data, 'h', 50);
  f.m.received(2, 50);
  f.m.withdraw(r2);  // half received: the caller's buffer is never written again
  s = f.m.space(2);
  CHECK(s.data != b2.data() + 50);
  std::memset(s.data, 'x', 50);
  f.m.received(2, 50);
  CHECK(!f.m.receiving(2));
  CHECK(!r2->finished);
  CHECK(b2[49] == 'h' && b2[50] == 0);
  CHECK(f.m.kept_count() == 1);  // the dropped message is not kept
}

void a_sender_that_left_fails_the_receives_that_wait_for_it() {
  Fixture f;
  auto b_mid = bytes(10, 0), b_next = bytes(3, 0), b_any = bytes(3, 0), b_two = bytes(3, 0);
  auto r_mid = recv(1, 0, b_mid), r_next = recv(1, 1, b_next), r_any = recv(-1, 2, b_any), r_two = recv(2, 2, b_two);
  for (auto& r : {r_mid, r_next, r_any, r_two}) f.m.post(r);
  arrive(f.m, 1, 5, bytes(3, 'k'));  // kept before it left
  f.m.begin(1, 0, 10);
  f.m.received(1, 4);
  f.m.source_gone(1, "closed its connection (it left the group or died)");
  CHECK(f.m.gone(1) && !f.m.gone(2));
  CHECK(r_mid->error == "rank 1 closed its connection (it left the group or died) in the middle of a message");
  CHECK(r_next->error == "rank 1 closed its connection (it left the group or died)");
  CHECK(!r_any->finished && !r_two->finished);  // others still wait
  CHECK(!f.m.receiving(1));
  auto b_late = bytes(3, 0);
  auto r_late = recv(1, 7, b_late);
  f.m.post(r_late);
  CHECK(r_late->finished && r_late->error == "rank 1 closed its connection (it left the group or died)");
  auto b_kept = bytes(3, 0);
  auto r_kept = recv(1, 5, b_kept);
  f.m.post(r_kept);
  CHECK(ok(r_kept) && b_kept == bytes(3, 'k'));  // what it sent before it left is still received
}

void a_parked_sender_that_left_is_not_resumed() {
  Fixture f;
  f.m.begin(1, 0, kParkMinBytes + 1);
  f.m.source_gone(1, "lost its connection (Connection reset by peer)");
  CHECK(!f.m.parked(1));
  auto b = bytes(4, 0);
  auto r = recv(-1, 0, b);
  f.m.post(r);
  CHECK(f.ev.resumed.empty());
  CHECK(!r->finished);
}

void a_message_to_itself_goes_to_a_posted_receive_or_is_kept_as_a_copy() {
  Fixture f;
  auto b = bytes(5, 0);
  auto r = recv(0, 1, b);
  f.m.post(r);
  auto sent = bytes(5, 'm');
  f.m.deliver_whole(0, 1, sent.data(), sent.size());
  CHECK(ok(r) && r->source == 0 && b == sent);
  f.m.deliver_whole(0, 1, sent.data(), sent.size());
  std::memset(sent.data(), '!', sent.size());  // the sender's buffer is free once it returned
  auto b2 = bytes(5, 0);
  auto r2 = recv(-1, 1, b2);
  f.m.post(r2);
  CHECK(ok(r2) && r2->source == 0 && b2 == bytes(5, 'm'));
}

void empty_messages_match_like_any_other() {
  Fixture f;
  std::vector<char> none;
  auto r = recv(1, 0, none);
  f.m.post(r);
  f.m.begin(1, 0, 0);  // no payload: complete at its header
  CHECK(ok(r) && r->source == 1);
  CHECK(!f.m.receiving(1));
  f.m.begin(2, 0, 0);
  CHECK(f.m.kept_count() == 1);
  auto r2 = recv(2, 0, none);
  f.m.post(r2);
  CHECK(ok(r2));
}

void the_first_failure_wins_and_shutdown_drops_the_posted_receives() {
  Fixture f;
  auto b = bytes(4, 0);
  auto r = recv(1, 0, b);
  f.m.post(r);
  f.m.fail(r, "first");
  f.m.fail(r, "second");
  CHECK(r->error == "first");
  CHECK(f.ev.finished_count == 1);
  f.m.drop_posted();
  CHECK(f.m.posted_count() == 0);
  arrive(f.m, 1, 0, bytes(4, 'n'));
  CHECK(b == bytes(4, 0));
  CHECK(f.m.kept_count() == 1);
}

struct Case {
  const char* name;
  void (*fn)();
};

#define CASE(f) {#f, f}
const Case kCases[] = {
    CASE(posted_receive_then_arrival),
    CASE(arrival_then_receive_takes_the_kept_message),
    CASE(a_message_arriving_in_pieces_lands_in_its_receive),
    CASE(any_source_takes_kept_messages_in_arrival_order),
    CASE(a_message_goes_to_the_oldest_posted_receive_that_fits),
    CASE(tags_must_match),
    CASE(fifo_per_source_and_tag),
    CASE(a_receive_posted_while_a_kept_message_arrives_takes_the_rest_in_place),
    CASE(a_large_message_nobody_waits_for_is_parked_until_a_receive_from_its_source),
    CASE(a_parked_message_resumed_by_another_tag_is_kept),
    CASE(any_source_receive_resumes_every_parked_source),
    CASE(small_messages_and_waited_for_senders_are_never_parked),
    CASE(a_receive_of_another_size_fails_naming_both_sizes_and_the_message_is_consumed),
    CASE(a_kept_message_of_another_size_fails_the_receive),
    CASE(a_receive_of_another_size_posted_mid_message_fails_when_it_completes),
    CASE(a_withdrawn_receive_is_not_matched_and_drops_the_rest_of_its_message),
    CASE(a_sender_that_left_fails_the_receives_that_wait_for_it),
    CASE(a_parked_sender_that_left_is_not_resumed),
    CASE(a_message_to_itself_goes_to_a_posted_receive_or_is_kept_as_a_copy),
    CASE(empty_messages_match_like_any_other),
    CASE(the_first_failure_wins_and_shutdown_drops_the_posted_receives),
};

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--list") == 0) {
    for (const Case& c : kCases) std::printf("%s\n", c.name);
    return 0;
  }
  int ran = 0;
  for (const Case& c : kCases) {
    if (argc > 1 && std::strcmp(argv[1], c.name) != 0) continue;
    int before = failures;
    c.fn();
    ++ran;
    std::printf("%s %s\n", failures == before ? "ok  " : "FAIL", c.name);
  }
  if (ran == 0) {
    std::printf("no case named %s\n", argc > 1 ? argv[1] : "");
    return 2;
  }
  return failures ? 1 : 0;
}
