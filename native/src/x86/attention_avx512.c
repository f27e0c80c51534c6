/* GQA attention on AVX-512: the reductions keep attention_body.h's eight-lane shape (so
 * the bits equal the portable and AVX2 builds), and the loops whose lanes never meet (the
 * weighted sums over the values, the softmax division) run sixteen lanes at a time. No
 * FMA, as in the other builds. */
#pragma GCC target("avx512f,avx2")

#define VW 8
#define WVW 16
#define ATTEND_ONE colibri_attend_one_avx512
#include "../attention_body.h"
