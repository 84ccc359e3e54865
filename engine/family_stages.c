#include "family_stages.h"

#include "family.h"

/* By kiln_family_of's id: a family added to the enum without its line here
 * leaves the table short, which the assertion refuses to compile. */
static const kiln_family_stages *const table[] = {
    [KILN_FAMILY_FLUX2] = &kiln_family_stages_klein,
    [KILN_FAMILY_ZIMAGE] = &kiln_family_stages_zimage,
};
_Static_assert(sizeof table / sizeof table[0] == KILN_FAMILY_COUNT,
               "every family of engine/family.h needs its stages here");

const kiln_family_stages *kiln_family_stages_of(const kiln_checkpoint *ck)
{
    return table[kiln_family_of(ck)->id];
}
