// There is no ZeRO stage 4.
#include <mpzero/policy/stage.hpp>

constexpr int bad = mpzero::stage<4>::value;
