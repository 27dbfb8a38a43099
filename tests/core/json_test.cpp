// The one JSON writer of the tools (dimattn/testing/json.h): `dimattn bench
// --json` and bench/'s programs write every string and number through it.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "dimattn/testing/json.h"

namespace dimattn::testing {
namespace {

TEST(Json, StringsEscapeQuotesBackslashesAndControlCharacters) {
  EXPECT_EQ(json_string(""), "\"\"");
  EXPECT_EQ(json_string("cpu_flash"), "\"cpu_flash\"");
  EXPECT_EQ(json_string("say \"hi\""), "\"say \\\"hi\\\"\"");
  EXPECT_EQ(json_string("C:\\path"), "\"C:\\\\path\"");
  EXPECT_EQ(json_string("a\nb\tc\rd\be\ff"), "\"a\\nb\\tc\\rd\\be\\ff\"");
  // Other control characters as \u00XX, never dropped (a gate's reason with
  // a stray byte must still say what it said).
  EXPECT_EQ(json_string(std::string("x\x01y\x1fz", 5)), "\"x\\u0001y\\u001fz\"");
  EXPECT_EQ(json_string(std::string("\0", 1)), "\"\\u0000\"");
  // Bytes from 0x20 up pass through: UTF-8 and DEL.
  EXPECT_EQ(json_string("ü \x7f"), "\"ü \x7f\"");
}

TEST(Json, NumbersAreNullWhenNotFinite) {
  EXPECT_EQ(json_number(1.5), "1.5");
  EXPECT_EQ(json_number(1234567.0), "1.23457e+06");
  EXPECT_EQ(json_number(-0.25), "-0.25");
  EXPECT_EQ(json_number(NAN), "null");
  EXPECT_EQ(json_number(INFINITY), "null");
  EXPECT_EQ(json_number(-INFINITY), "null");
}

}  // namespace
}  // namespace dimattn::testing
