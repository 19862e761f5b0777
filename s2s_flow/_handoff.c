/* Hand the GIL over when a node thread goes to sleep.
 *
 * The rings are Python, and Python cannot do one thing they need: wake other threads and
 * go to sleep *without holding the GIL in between*. A thread that releases a lock from
 * Python still holds the GIL; the thread it wakes finds the GIL taken, sleeps again on
 * it, and is woken a second time when the first thread blocks. That is two thread
 * switches per hop instead of one, and on a machine where a switch between cores costs
 * tens of microseconds it is most of a hop's latency.
 *
 * block(waiter, wakes, timeout) drops the GIL, releases every waiter in ``wakes`` (and
 * empties the list), then waits on ``waiter``: the woken threads find the GIL free.
 * wake_now(wakes) does the release alone, for a thread that goes on running (a stream
 * that hands over each item as it is made): it lets go of the GIL for that moment, so a
 * woken thread that runs at once (on one core, it may preempt this one) finds it free.
 * Waiter is a one-shot lock, created locked, that release() unlocks once; once woken it
 * stays woken. A signal interrupts the wait so that its handler runs (main thread).
 *
 * s2s_flow/rings.py has the same API in pure Python, used where this is not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>

typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    int released;
} Waiter;

static PyTypeObject WaiterType;

static PyObject *Waiter_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Waiter() takes no arguments");
        return NULL;
    }
    Waiter *self = (Waiter *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->lock = PyThread_allocate_lock();
    if (self->lock == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    return (PyObject *)self;
}

static void Waiter_dealloc(Waiter *self) {
    if (self->lock != NULL) {
        if (!self->released)
            PyThread_release_lock(self->lock);
        PyThread_free_lock(self->lock);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Waiter_release(Waiter *self, PyObject *unused) {
    if (!self->released) {
        self->released = 1;
        PyThread_release_lock(self->lock);
    }
    Py_RETURN_NONE;
}

static PyMethodDef Waiter_methods[] = {
    {"release", (PyCFunction)Waiter_release, METH_NOARGS, "Wake the thread sleeping on this waiter (once)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WaiterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "s2s_flow._handoff.Waiter",
    .tp_doc = "A one-shot lock a sleeping thread waits on; release() wakes it.",
    .tp_basicsize = sizeof(Waiter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Waiter_new,
    .tp_dealloc = (destructor)Waiter_dealloc,
    .tp_methods = Waiter_methods,
};

#define STACK_WAKES 16

/* Monotonic nanoseconds (3.13 made the clock public; before, only the underscored name). */
static long long monotonic_ns(void) {
#if PY_VERSION_HEX >= 0x030D0000
    PyTime_t t;
    (void)PyTime_MonotonicRaw(&t);
    return (long long)t;
#else
    return (long long)_PyTime_GetMonotonicClock();
#endif
}

/* Take the waiters of ``wakes`` that are still to be released, emptying the list: each is
 * marked released and kept alive in held[] (stack or heap) until drop_taken().
 * Returns 0 when done; -1 when refused with nothing taken (error set); 1 when taken but the
 * list could not be emptied (error set: the caller still releases what it took). */
typedef struct {
    PyObject *stack[STACK_WAKES], **held;
    Py_ssize_t k;
} Taken;

static int take_wakes(PyObject *wakes, Taken *t, const char *who) {
    Py_ssize_t n = PyList_GET_SIZE(wakes);
    t->held = t->stack;
    t->k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {  /* check everything before taking anything */
        if (!PyObject_TypeCheck(PyList_GET_ITEM(wakes, i), &WaiterType)) {
            PyErr_Format(PyExc_TypeError, "%s(): wakes must hold Waiter objects", who);
            return -1;
        }
    }
    if (n > STACK_WAKES && (t->held = PyMem_New(PyObject *, n)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Waiter *w = (Waiter *)PyList_GET_ITEM(wakes, i);
        if (!w->released) {
            w->released = 1;
            Py_INCREF(w);  /* kept alive until its lock is released */
            t->held[t->k++] = (PyObject *)w;
        }
    }
    return PyList_SetSlice(wakes, 0, n, NULL) == 0 ? 0 : 1;
}

/* Without the GIL: wake every taken waiter. */
static void release_taken(Taken *t) {
    for (Py_ssize_t j = 0; j < t->k; j++)
        PyThread_release_lock(((Waiter *)t->held[j])->lock);
}

/* With the GIL: let go of the taken waiters. */
static void drop_taken(Taken *t) {
    for (Py_ssize_t j = 0; j < t->k; j++)
        Py_DECREF(t->held[j]);
    if (t->held != t->stack)
        PyMem_Free(t->held);
}

static PyObject *wake_now(PyObject *module, PyObject *wakes) {
    if (!PyList_Check(wakes)) {
        PyErr_SetString(PyExc_TypeError, "wake_now(): wakes must be a list");
        return NULL;
    }
    if (PyList_GET_SIZE(wakes) == 0)
        Py_RETURN_NONE;
    Taken t;
    int taken = take_wakes(wakes, &t, "wake_now");
    if (taken < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    release_taken(&t);
    Py_END_ALLOW_THREADS
    drop_taken(&t);
    if (taken != 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *block(PyObject *module, PyObject *args) {
    PyObject *waiter, *wakes;
    double timeout;
    if (!PyArg_ParseTuple(args, "O!O!d:block", &WaiterType, &waiter, &PyList_Type, &wakes, &timeout))
        return NULL;
    Taken t;
    int taken = take_wakes(wakes, &t, "block");
    if (taken < 0)
        return NULL;
    int listed = taken == 0;  /* else: release what was taken, do not wait, raise */
    PyObject *result = NULL;
    PyLockStatus got = PY_LOCK_FAILURE;
    PY_TIMEOUT_T micros = -1;
    long long deadline = 0;
    if (timeout >= 0) {
        micros = timeout * 1e6 >= (double)PY_TIMEOUT_MAX ? PY_TIMEOUT_MAX : (PY_TIMEOUT_T)(timeout * 1e6);
        deadline = monotonic_ns() + (long long)micros * 1000;
    }
    PyThread_type_lock own = ((Waiter *)waiter)->lock;
    Py_INCREF(waiter);
    Py_BEGIN_ALLOW_THREADS
    release_taken(&t);
    if (listed)
        got = PyThread_acquire_lock_timed(own, micros, 1);
    Py_END_ALLOW_THREADS
    /* Interrupted by a signal: run its handler (main thread), then wait for what is left. */
    while (listed && got == PY_LOCK_INTR) {
        if (PyErr_CheckSignals() < 0)
            break;
        if (micros > 0) {
            long long left = deadline - monotonic_ns();
            micros = left > 0 ? (PY_TIMEOUT_T)(left / 1000) : 0;
        }
        Py_BEGIN_ALLOW_THREADS
        got = PyThread_acquire_lock_timed(own, micros, 1);
        Py_END_ALLOW_THREADS
    }
    if (got == PY_LOCK_ACQUIRED)
        PyThread_release_lock(own);  /* left unlocked: woken once, it stays woken */
    if (!PyErr_Occurred())
        result = PyBool_FromLong(got == PY_LOCK_ACQUIRED);
    Py_DECREF(waiter);
    drop_taken(&t);
    return result;
}

static PyMethodDef module_methods[] = {
    {"block", block, METH_VARARGS,
     "block(waiter, wakes, timeout) -> bool: without the GIL, release the waiters in wakes (emptying\n"
     "the list), then wait on waiter up to timeout seconds (< 0: no limit); True when woken."},
    {"wake_now", wake_now, METH_O,
     "wake_now(wakes): release the waiters in wakes (emptying the list) with the GIL let go for the\n"
     "moment, so that a woken thread that runs at once finds it free."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "s2s_flow._handoff", "Hand the GIL over when a node thread goes to sleep.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__handoff(void) {
    if (PyType_Ready(&WaiterType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&WaiterType);
    if (PyModule_AddObject(m, "Waiter", (PyObject *)&WaiterType) < 0) {
        Py_DECREF(&WaiterType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
