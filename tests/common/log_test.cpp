#include "kdn/common/log.h"

#include <chrono>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace kdn {
namespace {

using namespace std::chrono_literals;
using TimePoint = LogLimiter::TimePoint;

// A clock the test moves by hand.
struct FakeClock {
  TimePoint now{std::chrono::hours(1)};
  std::function<TimePoint()> Fn() {
    return [this] { return now; };
  }
};

// Runs `body` with stderr captured and returns the lines it wrote.
template <typename F>
std::vector<std::string> StderrLines(F body) {
  testing::internal::CaptureStderr();
  body();
  const std::string text = testing::internal::GetCapturedStderr();
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t nl; (nl = text.find('\n', start)) != std::string::npos; start = nl + 1) {
    lines.push_back(text.substr(start, nl - start));
  }
  return lines;
}

// Restores the level a test changed.
class LogTest : public testing::Test {
 protected:
  void SetUp() override { saved_ = GetLogLevel(); }
  void TearDown() override { SetLogLevel(saved_); }
  LogLevel saved_ = LogLevel::kInfo;
};

TEST(LogLevel, ParsesEveryNameItPrints) {
  for (LogLevel l : {LogLevel::kTrace, LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarn,
                     LogLevel::kError, LogLevel::kOff}) {
    auto parsed = ParseLogLevel(LogLevelName(l));
    ASSERT_TRUE(parsed.ok()) << LogLevelName(l);
    EXPECT_EQ(*parsed, l);
  }
  auto bad = ParseLogLevel("verbose");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("trace, debug, info, warn, error, off"), std::string::npos);
}

TEST_F(LogTest, LineHasTimestampLevelRoleAndRequestId) {
  InitLog("prefill", "prefill-3", LogLevel::kInfo);
  const auto lines = StderrLines([] { LogInfo("{} received: {} tokens", ReqId{0x2a}, 12); });
  ASSERT_EQ(lines.size(), 1u);
  const std::regex want(R"(^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z info  prefill/prefill-3 )"
                        R"(req=000000000000002a received: 12 tokens$)");
  EXPECT_TRUE(std::regex_match(lines[0], want)) << lines[0];
}

TEST_F(LogTest, LinesBelowTheLevelAreDropped) {
  InitLog("router", "", LogLevel::kWarn);
  const auto lines = StderrLines([] {
    LogDebug("a debug line");
    LogInfo("an info line");
    LogWarn("a warning");
    LogError("an error");
  });
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0].find(" warn  router a warning"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find(" error router an error"), std::string::npos) << lines[1];
  SetLogLevel(LogLevel::kOff);
  EXPECT_TRUE(StderrLines([] { LogError("nothing at off"); }).empty());
}

TEST(FormatRequestId, IsSixteenHexDigits) {
  EXPECT_EQ(FormatRequestId(0x2a), "000000000000002a");
  EXPECT_EQ(FormatRequestId(~uint64_t{0}), "ffffffffffffffff");
  EXPECT_EQ(fmt::format("{}", ReqId{0xabc}), "req=0000000000000abc");
  EXPECT_EQ(fmt::format("{}", HexBytes{std::string_view("\x00\x7f\xff", 3)}), "007fff");
}

TEST(LogLimiter, LetsThroughItsQuotaPerSecondThenCounts) {
  FakeClock clock;
  LogLimiter limiter(3, clock.Fn());
  for (int i = 0; i < 3; ++i) {
    const auto d = limiter.Admit();
    EXPECT_TRUE(d.emit) << i;
    EXPECT_EQ(d.suppressed, 0u);
  }
  for (int i = 0; i < 100; ++i) {
    clock.now += 5ms;  // 500 ms in all: still the same window
    EXPECT_FALSE(limiter.Admit().emit) << i;
  }
  clock.now += 500ms;
  const auto d = limiter.Admit();
  EXPECT_TRUE(d.emit);
  EXPECT_EQ(d.suppressed, 100u);
  // The count was reported once.
  const auto next = limiter.Admit();
  EXPECT_TRUE(next.emit);
  EXPECT_EQ(next.suppressed, 0u);
}

TEST(LogLimiter, AQuietSecondStartsAFreshQuota) {
  FakeClock clock;
  LogLimiter limiter(2, clock.Fn());
  EXPECT_TRUE(limiter.Admit().emit);
  EXPECT_TRUE(limiter.Admit().emit);
  EXPECT_FALSE(limiter.Admit().emit);
  clock.now += 10s;
  const auto d = limiter.Admit();
  EXPECT_TRUE(d.emit);
  EXPECT_EQ(d.suppressed, 1u);
  EXPECT_TRUE(limiter.Admit().emit);
  EXPECT_FALSE(limiter.Admit().emit);
}

TEST_F(LogTest, LimiterWritesOneSuppressedLineBeforeTheNextMessage) {
  InitLog("router", "", LogLevel::kInfo);
  FakeClock clock;
  LogLimiter limiter(2, clock.Fn());
  auto lines = StderrLines([&] {
    for (int i = 0; i < 1000; ++i) limiter.Error("accept: {}", "Too many open files");
  });
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0].find("error router accept: Too many open files"), std::string::npos);
  clock.now += 1s;
  lines = StderrLines([&] { limiter.Error("accept: {}", "Too many open files"); });
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0].find("suppressed 998 similar messages"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("accept: Too many open files"), std::string::npos) << lines[1];
}

TEST_F(LogTest, LimiterCountsNothingWhileItsLevelIsOff) {
  InitLog("router", "", LogLevel::kError);
  FakeClock clock;
  LogLimiter limiter(1, clock.Fn());
  const auto lines = StderrLines([&] {
    for (int i = 0; i < 10; ++i) limiter.Warn("dropped at level error");
  });
  EXPECT_TRUE(lines.empty());
  const auto d = limiter.Admit();
  EXPECT_TRUE(d.emit);
  EXPECT_EQ(d.suppressed, 0u);
}

}  // namespace
}  // namespace kdn
