/* diffusers pipeline folders.  model_index.json lists components as
 * "name": [library, class]; optional components diffusers leaves out are
 * written as [null, null] and are skipped here, as DiffusionPipeline does. */
#include "checkpoint.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "json.h"
#include "linkstub.h"

#define CK_MAX_COMPONENTS 16
#define CK_NAME_MAX 64

typedef struct ck_component {
    char name[CK_NAME_MAX];
    cJSON *config;
} ck_component;

struct kiln_checkpoint {
    char dir[PATH_MAX];
    cJSON *index;
    kiln_pipeline_kind kind;
    int is_distilled;
    ck_component comp[CK_MAX_COMPONENTS];
    int ncomp;
};

static const struct {
    const char *class_name;
    kiln_pipeline_kind kind;
} pipelines[] = {
    {"Flux2KleinPipeline", KILN_PIPE_FLUX2_KLEIN},
    {"Flux2KleinKVPipeline", KILN_PIPE_FLUX2_KLEIN_KV},
    {"ZImagePipeline", KILN_PIPE_ZIMAGE},
};

/* diffusers keeps scheduler and tokenizer settings under their own names
 * (SchedulerMixin.config_name, transformers' tokenizer_config.json). */
static const char *config_file(const char *component)
{
    if (!strcmp(component, "scheduler"))
        return "scheduler_config.json";
    if (!strcmp(component, "tokenizer"))
        return "tokenizer_config.json";
    return "config.json";
}

static int known_component(const char *name)
{
    static const char *const known[] = {"transformer", "text_encoder", "vae", "scheduler",
                                        "tokenizer"};
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (!strcmp(name, known[i]))
            return 1;
    return 0;
}

static int plain_name(const char *s)
{
    size_t n = strlen(s);
    return n && n < CK_NAME_MAX && s[0] != '.' && !strchr(s, '/') && !strchr(s, '\\');
}

static int is_dir(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

static int is_file(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

void kiln_checkpoint_close(kiln_checkpoint *ck)
{
    if (!ck)
        return;
    for (int i = 0; i < ck->ncomp; i++)
        cJSON_Delete(ck->comp[i].config);
    cJSON_Delete(ck->index);
    free(ck);
}

static kiln_status parse_kind(kiln_checkpoint *ck, kiln_err *err)
{
    const char *cls = kiln_json_string(ck->index, "_class_name", 1, err);
    if (!cls)
        return kiln_err_wrap(err, "model_index.json");
    for (size_t i = 0; i < sizeof pipelines / sizeof pipelines[0]; i++) {
        if (!strcmp(cls, pipelines[i].class_name)) {
            ck->kind = pipelines[i].kind;
            int d;
            if (kiln_json_bool(ck->index, "is_distilled", 0, 0, &d, err))
                return kiln_err_wrap(err, "model_index.json");
            ck->is_distilled = d;
            return KILN_OK;
        }
    }
    return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                        "unsupported pipeline '%.64s' (kiln runs Flux2KleinPipeline, "
                        "Flux2KleinKVPipeline and ZImagePipeline)", cls);
}

static kiln_status load_component(kiln_checkpoint *ck, const char *name, kiln_err *err)
{
    if (ck->ncomp == CK_MAX_COMPONENTS)
        return kiln_err_set(err, KILN_ERR_FORMAT, "model_index.json lists too many components");
    char path[PATH_MAX + 64], label[CK_NAME_MAX + 32];
    snprintf(path, sizeof path, "%s/%s", ck->dir, name);
    if (!is_dir(path))
        return kiln_err_set(err, KILN_ERR_NOT_FOUND, "checkpoint is missing its %s/ component",
                            name);
    const char *cfg = config_file(name);
    snprintf(path, sizeof path, "%s/%s/%s", ck->dir, name, cfg);
    snprintf(label, sizeof label, "%s/%s", name, cfg);
    ck_component *c = &ck->comp[ck->ncomp];
    snprintf(c->name, sizeof c->name, "%s", name);
    if (!is_file(path)) {
        /* Components kiln runs must have their settings; others (an image
         * processor, say) keep theirs under names we do not read. */
        if (known_component(name))
            return kiln_err_set(err, KILN_ERR_NOT_FOUND, "checkpoint's %s/ component has no %s",
                                name, cfg);
        ck->ncomp++;
        return KILN_OK;
    }
    cJSON *doc = kiln_json_load(path, label, err);
    if (!doc)
        return err ? err->code : KILN_ERR_IO;
    if (!cJSON_IsObject(doc)) {
        cJSON_Delete(doc);
        return kiln_err_set(err, KILN_ERR_FORMAT, "%s is not a JSON object", label);
    }
    c->config = doc;
    ck->ncomp++;
    return KILN_OK;
}

kiln_checkpoint *kiln_checkpoint_open(const char *dir, kiln_err *err)
{
    kiln_checkpoint *ck = calloc(1, sizeof *ck);
    if (!ck) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    /* Resolved once so kiln_checkpoint_path hands out absolute paths and
     * symlinked checkpoint folders behave like real ones. */
    if (!realpath(dir, ck->dir) || !is_dir(ck->dir)) {
        kiln_err_set(err, KILN_ERR_NOT_FOUND, "checkpoint folder not found");
        goto fail;
    }
    char path[PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/model_index.json", ck->dir);
    if (!(ck->index = kiln_json_load(path, "model_index.json", err)))
        goto fail;
    if (!cJSON_IsObject(ck->index)) {
        kiln_err_set(err, KILN_ERR_FORMAT, "model_index.json is not a JSON object");
        goto fail;
    }
    if (parse_kind(ck, err))
        goto fail;
    const cJSON *e;
    cJSON_ArrayForEach(e, ck->index)
    {
        if (e->string[0] == '_' || !cJSON_IsArray(e))
            continue;
        const cJSON *lib = cJSON_GetArrayItem(e, 0), *cls = cJSON_GetArrayItem(e, 1);
        if (cJSON_GetArraySize(e) != 2 || cJSON_IsNull(lib) || cJSON_IsNull(cls))
            continue;
        if (!cJSON_IsString(lib) || !cJSON_IsString(cls)) {
            kiln_err_set(err, KILN_ERR_FORMAT,
                         "model_index.json: component '%.64s' must be [library, class]",
                         e->string);
            goto fail;
        }
        if (!plain_name(e->string)) {
            kiln_err_set(err, KILN_ERR_FORMAT,
                         "model_index.json: component name '%.64s' is not a plain folder name",
                         e->string);
            goto fail;
        }
        if (load_component(ck, e->string, err))
            goto fail;
    }
    return ck;
fail:
    kiln_checkpoint_close(ck);
    return NULL;
}

kiln_pipeline_kind kiln_checkpoint_pipeline(const kiln_checkpoint *ck) { return ck->kind; }

int kiln_checkpoint_is_distilled(const kiln_checkpoint *ck) { return ck->is_distilled; }

const cJSON *kiln_checkpoint_index(const kiln_checkpoint *ck) { return ck->index; }

static const ck_component *find_component(const kiln_checkpoint *ck, const char *component,
                                          kiln_err *err)
{
    for (int i = 0; i < ck->ncomp; i++)
        if (!strcmp(ck->comp[i].name, component))
            return &ck->comp[i];
    kiln_err_set(err, KILN_ERR_NOT_FOUND, "checkpoint has no %.64s component", component);
    return NULL;
}

const cJSON *kiln_checkpoint_config(const kiln_checkpoint *ck, const char *component,
                                    kiln_err *err)
{
    const ck_component *c = find_component(ck, component, err);
    if (c && !c->config)
        kiln_err_set(err, KILN_ERR_NOT_FOUND, "checkpoint's %.64s/ component has no config",
                     component);
    return c ? c->config : NULL;
}

kiln_st *kiln_checkpoint_weights(const kiln_checkpoint *ck, const char *component,
                                 kiln_err *err)
{
    const ck_component *c = find_component(ck, component, err);
    if (!c)
        return NULL;
    /* diffusers models save diffusion_pytorch_model.*, transformers models
     * (the text encoder) model.*; a sharded set wins over a single file as
     * in both libraries' from_pretrained. */
    static const char *const names[] = {
        "diffusion_pytorch_model.safetensors.index.json",
        "diffusion_pytorch_model.safetensors",
        "model.safetensors.index.json",
        "model.safetensors",
    };
    char path[PATH_MAX + 128];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(path, sizeof path, "%s/%s/%s", ck->dir, c->name, names[i]);
        if (is_file(path))
            return kiln_st_open(path, c->name, err);
    }
    snprintf(path, sizeof path, "%s/%s", ck->dir, c->name);
    return kiln_st_open(path, c->name, err);
}

kiln_status kiln_checkpoint_path(const kiln_checkpoint *ck, const char *component, char *buf,
                                 size_t len, kiln_err *err)
{
    const ck_component *c = find_component(ck, component, err);
    if (!c)
        return err ? err->code : KILN_ERR_NOT_FOUND;
    if ((size_t)snprintf(buf, len, "%s/%s", ck->dir, c->name) >= len)
        return kiln_err_set(err, KILN_ERR_INVALID, "buffer too small for the %s path",
                            component);
    return KILN_OK;
}

kiln_status kiln_checkpoint_file(const kiln_checkpoint *ck, const char *component,
                                 const char *file, char *buf, size_t len, kiln_err *err)
{
    const ck_component *c = find_component(ck, component, err);
    if (!c)
        return err ? err->code : KILN_ERR_NOT_FOUND;
    char path[PATH_MAX + 128];
    if ((size_t)snprintf(path, sizeof path, "%s/%s/%s", ck->dir, c->name, file) >= sizeof path ||
        kiln_linkstub_resolve(path, buf, len) != 0)
        return kiln_err_set(err, KILN_ERR_INVALID, "path of %s/%.64s is too long", component,
                            file);
    if (!is_file(buf))
        return kiln_err_set(err, KILN_ERR_NOT_FOUND, "checkpoint's %s/ component has no %.64s",
                            component, file);
    return KILN_OK;
}
