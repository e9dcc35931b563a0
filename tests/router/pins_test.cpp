#include "kdn/router/pins.h"

#include <gtest/gtest.h>

#include <chrono>
#include <vector>

namespace kdn::router {
namespace {

using std::chrono::seconds;
using Clock = PinBook::Clock;

// A prompt's chunk keys: chained, so prompts that share a prefix share its
// keys and no more.
std::vector<kvbus::ChunkKey> Keys(uint64_t prompt, size_t n, size_t shared = 0) {
  std::vector<kvbus::ChunkKey> keys;
  for (size_t i = 0; i < n; ++i) keys.push_back({i < shared ? 1 : prompt, i + 1});
  return keys;
}

const Clock::time_point kT0 = Clock::time_point(std::chrono::hours(5));

TEST(PinBook, APinLivesForItsTtlAndEachHitRefreshesIt) {
  PinBook book(1000);
  const auto keys = Keys(7, 4);
  auto g = book.Pin("t", keys, 256, 100, seconds(60), kT0);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_TRUE(g->created);
  EXPECT_EQ(g->order.keys, keys);
  EXPECT_EQ(g->order.lease, seconds(60));
  EXPECT_EQ(g->info.id, "pin-" + keys.back().ToHex());
  EXPECT_EQ(g->info.expires_at - g->info.created_at, 60);
  // A longer prompt over the same prefix reaches it and refreshes it.
  auto hit = book.Touch("t", Keys(7, 6), kT0 + seconds(50));
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->info.tokens, 256);
  EXPECT_EQ(hit->info.hits, 1u);
  // 10 s were left of the workers' keep: it is renewed.
  ASSERT_EQ(hit->renew.size(), 1u);
  EXPECT_EQ(hit->renew[0].keys, keys);
  EXPECT_EQ(hit->renew[0].lease, seconds(60));
  // Right after, a hit renews nothing more.
  auto again = book.Touch("t", keys, kT0 + seconds(51));
  ASSERT_TRUE(again.has_value());
  EXPECT_TRUE(again->renew.empty());
  // A prompt that shares only part of the prefix does not reach it.
  EXPECT_FALSE(book.Touch("t", Keys(8, 6, 3), kT0 + seconds(52)).has_value());
  EXPECT_EQ(book.List("t", kT0 + seconds(110)).size(), 1u);
  EXPECT_TRUE(book.List("t", kT0 + seconds(111)).empty());
  EXPECT_FALSE(book.Touch("t", keys, kT0 + seconds(112)).has_value());
  const PinBook::Totals totals = book.totals();
  EXPECT_EQ(totals.pins, 0u);
  EXPECT_EQ(totals.bytes, 0u);
  EXPECT_EQ(totals.hits, 2u);
}

TEST(PinBook, TheSamePrefixPinnedAgainIsOnePinThatLastsTheLonger) {
  PinBook book(150);
  const auto keys = Keys(7, 2);
  ASSERT_TRUE(book.Pin("t", keys, 128, 100, seconds(3600), kT0).ok());
  auto again = book.Pin("t", keys, 128, 100, seconds(300), kT0 + seconds(10));
  ASSERT_TRUE(again.ok()) << again.status().ToString();  // not a second 100 bytes
  EXPECT_FALSE(again->created);
  EXPECT_EQ(again->info.ttl, seconds(3600));
  EXPECT_TRUE(again->order.keys.empty());  // the workers keep it long enough
  EXPECT_EQ(book.List("t", kT0 + seconds(3599)).size(), 1u);
  EXPECT_EQ(book.totals().bytes, 100u);
}

TEST(PinBook, APinPastTheTenantsBoundIsRefusedSayingByHowMuch) {
  PinBook book(uint64_t{3} << 20);
  ASSERT_TRUE(book.Pin("a", Keys(1, 2), 128, uint64_t{2} << 20, seconds(60), kT0).ok());
  auto over = book.Pin("a", Keys(2, 2), 128, uint64_t{2} << 20, seconds(60), kT0);
  ASSERT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("4.0 MiB, past its bound of 3.0 MiB"), std::string::npos)
      << over.status().message();
  // Another tenant has a bound of its own.
  EXPECT_TRUE(book.Pin("b", Keys(2, 2), 128, uint64_t{2} << 20, seconds(60), kT0).ok());
  EXPECT_EQ(book.totals().refused, 1u);
  EXPECT_EQ(book.totals().pins, 2u);
  // Once the first has expired there is room.
  EXPECT_TRUE(
      book.Pin("a", Keys(2, 2), 128, uint64_t{2} << 20, seconds(60), kT0 + seconds(60)).ok());
  EXPECT_EQ(PinBook(0).Pin("a", Keys(1, 1), 64, 1, seconds(60), kT0).status().code(),
            StatusCode::kResourceExhausted);
}

TEST(PinBook, TenantsSeeAndDropOnlyTheirOwnPins) {
  PinBook book(1000);
  auto a = book.Pin("a", Keys(1, 2), 128, 10, seconds(60), kT0);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(book.Pin("b", Keys(2, 2), 128, 10, seconds(60), kT0).ok());
  EXPECT_EQ(book.List("a", kT0).size(), 1u);
  EXPECT_FALSE(book.Touch("b", Keys(1, 2), kT0).has_value());
  EXPECT_EQ(book.Drop("b", a->info.id, kT0).status().code(), StatusCode::kNotFound);
  auto dropped = book.Drop("a", a->info.id, kT0);
  ASSERT_TRUE(dropped.ok());
  EXPECT_EQ(dropped->keys, Keys(1, 2));
  EXPECT_EQ(dropped->lease.count(), 0);
  EXPECT_TRUE(book.List("a", kT0).empty());
  EXPECT_EQ(book.List("b", kT0).size(), 1u);
  EXPECT_EQ(book.Drop("a", a->info.id, kT0).status().code(), StatusCode::kNotFound);
}

TEST(PinBook, DroppingAPinLetsGoOnlyOfTheKeysNoOtherPinHolds) {
  PinBook book(1000);
  const auto longer = Keys(1, 4);
  ASSERT_TRUE(book.Pin("a", longer, 256, 10, seconds(60), kT0).ok());
  auto shorter = book.Pin("a", Keys(1, 2), 128, 10, seconds(60), kT0);
  ASSERT_TRUE(shorter.ok());
  auto dropped = book.Drop("a", shorter->info.id, kT0);
  ASSERT_TRUE(dropped.ok());
  EXPECT_TRUE(dropped->keys.empty());  // the longer pin holds them
  auto all = book.Drop("a", "", kT0);  // every pin of the tenant
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->keys, longer);
  EXPECT_TRUE(book.Drop("a", "", kT0).ok());  // none left: nothing to do
}

TEST(PinBook, TtlsAreAnthropicsOrWholeUnitsWithinADay) {
  EXPECT_EQ(ParsePinTtl("5m"), seconds(300));
  EXPECT_EQ(ParsePinTtl("1h"), seconds(3600));
  EXPECT_EQ(ParsePinTtl("90s"), seconds(90));
  EXPECT_EQ(ParsePinTtl("24h"), seconds(86400));
  for (const char* bad : {"", "m", "0s", "-5m", "25h", "1441m", "5", "5 m", "1.5h", "5d", "h1"}) {
    EXPECT_FALSE(ParsePinTtl(bad).has_value()) << bad;
  }
}

}  // namespace
}  // namespace kdn::router
